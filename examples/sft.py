"""DP supervised fine-tuning with TRL: TRL's ``trl/scripts/sft.py`` with the three-name change.

Compared with TRL's script, only ``SFTConfig`` -> ``DPSFTConfig``, ``SFTTrainer`` -> ``DPSFTTrainer`` and the import
change (plus ``--train_file`` for a local json/jsonl/csv/parquet file); every TRL flag keeps its meaning
(``--use_peft``, ``--lora_r``, ``--assistant_only_loss``, ``--completion_only_loss``, ``--max_length``, ...), and the DP
flags are hf_dp's (``--target_epsilon``, ``--per_sample_max_grad_norm``, ...). Needs ``pip install 'hf_dp[trl]'``.

    python examples/sft.py --model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/Capybara \
        --use_peft --lora_r 16 --lora_target_modules all-linear --learning_rate 1e-3 \
        --per_device_train_batch_size 8 --gradient_accumulation_steps 32 --num_train_epochs 3 \
        --target_epsilon 8 --per_sample_max_grad_norm 1.0 --output_dir Qwen2-0.5B-DP-SFT

Packing: ``--packing`` (TRL's default strategy, ``bfd``, padding-free: each sequence is the unit of privacy, sampled
and clipped on its own inside the packed rows), or ``--packing --packing_strategy wrapped`` (each packed row of
``--max_length`` tokens is then the unit of privacy); ``bfd_split`` is refused with what to set.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from hf_dp import DPSFTConfig, DPSFTTrainer  # was: from trl import SFTConfig, SFTTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_common import DataFileArguments, finish, load_splits, set_model_init_kwargs  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = TrlParser((ScriptArguments, DPSFTConfig, ModelConfig, DataFileArguments))
    script_args, training_args, model_args, files = parser.parse_args_and_config(
        args=sys.argv[1:] if argv is None else argv
    )
    set_model_init_kwargs(model_args, training_args)  # as TRL's sft.py
    train, evaluation = load_splits(script_args, files, training_args.eval_strategy)

    trainer = DPSFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    return finish(trainer, training_args, script_args, "sft")


if __name__ == "__main__":
    main()
