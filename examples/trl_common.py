"""What examples/sft.py, examples/dpo.py and examples/trl_reward.py share beyond TRL's scripts: a local data file, the
model-loading keywords as TRL's scripts set them, and the DP report written next to the model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from datasets import load_dataset
from trl import ModelConfig, ScriptArguments


@dataclass
class DataFileArguments:
    train_file: str | None = field(
        default=None, metadata={"help": "A local json/jsonl/csv/parquet file instead of `--dataset_name`."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training rows."})


def load_splits(script_args: ScriptArguments, files: DataFileArguments, eval_strategy: str):
    """``(train, eval or None)``: the training split (its first ``max_train_samples`` rows) and, when evaluation is
    on and the data has it, the test split."""
    if files.train_file is not None:
        suffix = files.train_file.rsplit(".", 1)[-1]
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}[suffix]
        dataset = load_dataset(builder, data_files={script_args.dataset_train_split: files.train_file})
    elif script_args.dataset_name is None:
        raise ValueError("Give `--dataset_name` (a Hub dataset or a local folder) or `--train_file`.")
    else:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    train = dataset[script_args.dataset_train_split]
    if files.max_train_samples is not None:
        train = train.select(range(min(files.max_train_samples, len(train))))
    evaluate = eval_strategy != "no" and script_args.dataset_test_split in dataset
    return train, dataset[script_args.dataset_test_split] if evaluate else None


def set_model_init_kwargs(model_args: ModelConfig, training_args) -> None:
    """The keywords the trainer loads the model with, as TRL's scripts set them."""
    kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = kwargs


def finish(trainer, training_args, script_args: ScriptArguments, task: str) -> dict:
    """Train, save, write ``dp_report.json`` (main process), print epsilon, push if asked; the report."""
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    report = {"task": task, "privacy": trainer.dp_summary()}
    if training_args.process_index == 0:
        with open(os.path.join(training_args.output_dir, "dp_report.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
    trainer.accelerator.print(f"Saved to {training_args.output_dir}; epsilon = {trainer.epsilon():.3g}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return report
