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

import json
import os
import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from hf_dp import DPDPOConfig, DPDPOTrainer  # was: from trl import DPOConfig, DPOTrainer


@dataclass
class DataFileArguments:
    train_file: str | None = field(
        default=None,
        metadata={"help": "A local json/jsonl/csv/parquet file of preference pairs instead of `--dataset_name`."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training pairs."})


def load_data(script_args: ScriptArguments, files: DataFileArguments):
    if files.train_file is not None:
        suffix = files.train_file.rsplit(".", 1)[-1]
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}[suffix]
        return load_dataset(builder, data_files={script_args.dataset_train_split: files.train_file})
    if script_args.dataset_name is None:
        raise ValueError("Give `--dataset_name` (a Hub dataset or a local folder) or `--train_file`.")
    return load_dataset(script_args.dataset_name, name=script_args.dataset_config)


def main(argv: list[str] | None = None) -> dict:
    parser = TrlParser((ScriptArguments, DPDPOConfig, ModelConfig, DataFileArguments))
    script_args, training_args, model_args, files = parser.parse_args_and_config(
        args=sys.argv[1:] if argv is None else argv
    )
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs  # as TRL's dpo.py

    dataset = load_data(script_args, files)
    train = dataset[script_args.dataset_train_split]
    if files.max_train_samples is not None:
        train = train.select(range(min(files.max_train_samples, len(train))))
    evaluate = training_args.eval_strategy != "no" and script_args.dataset_test_split in dataset

    trainer = DPDPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train,
        eval_dataset=dataset[script_args.dataset_test_split] if evaluate else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    if script_args.ignore_bias_buffers:  # as TRL's dpo.py: DDP skips the boolean buffers
        import torch

        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    report = {"task": "dpo", "privacy": trainer.dp_summary()}
    if training_args.process_index == 0:
        with open(os.path.join(training_args.output_dir, "dp_report.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
    trainer.accelerator.print(f"Saved to {training_args.output_dir}; epsilon = {trainer.epsilon():.3g}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return report


if __name__ == "__main__":
    main()
