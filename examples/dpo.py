"""DP preference optimization (DPO) with TRL: TRL's ``trl/scripts/dpo.py`` with the three-name change.

Compared with TRL's script, only ``DPOConfig`` -> ``DPDPOConfig``, ``DPOTrainer`` -> ``DPDPOTrainer`` and the import
change (plus ``--train_file`` for a local json/jsonl/csv/parquet file of preference pairs and ``--max_train_samples``).
Every TRL flag keeps its meaning (``--beta``, ``--loss_type``, ``--use_peft``, ``--lora_r``, ``--max_length``,
``--precompute_ref_log_probs``, ...); the DP flags are hf_dp's (``--target_epsilon``, ``--per_sample_max_grad_norm``,
...). The unit of privacy is one preference pair: one row ``prompt``/``chosen``/``rejected`` (standard or
conversational; or ``chosen``/``rejected`` with an implicit prompt). Needs ``pip install 'hf_dp[trl]'``.

    python examples/dpo.py --model_name_or_path Qwen/Qwen2-0.5B-Instruct \
        --dataset_name trl-lib/ultrafeedback_binarized \
        --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear --learning_rate 5e-5 \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 64 --num_train_epochs 1 \
        --target_epsilon 8 --per_sample_max_grad_norm 1.0 --output_dir Qwen2-0.5B-DP-DPO

With ``--use_peft`` the reference model is the base model with the adapter switched off (as in TRL); without it, a
frozen copy of the initial policy. The reference is never clipped, noised or trained.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from hf_dp import DPDPOConfig, DPDPOTrainer  # was: from trl import DPOConfig, DPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_common import DataFileArguments, finish, load_splits, set_model_init_kwargs  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = TrlParser((ScriptArguments, DPDPOConfig, ModelConfig, DataFileArguments))
    script_args, training_args, model_args, files = parser.parse_args_and_config(
        args=sys.argv[1:] if argv is None else argv
    )
    set_model_init_kwargs(model_args, training_args)  # as TRL's dpo.py
    train, evaluation = load_splits(script_args, files, training_args.eval_strategy)

    trainer = DPDPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    if script_args.ignore_bias_buffers:  # as TRL's dpo.py: DDP skips the boolean buffers
        import torch

        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]
    return finish(trainer, training_args, script_args, "dpo")


if __name__ == "__main__":
    main()
