"""Checks DPTrainer runs before ``Trainer.__init__``: settings that would break the guarantee fail here, not at
the first step."""

from __future__ import annotations

from torch.utils.data import IterableDataset
from transformers import TrainingArguments

from .arguments import DPTrainingArguments
from .engine import plan_coverage

__all__ = ["check_before_init", "dp_arguments"]


def dp_arguments(args: TrainingArguments | None) -> DPTrainingArguments:
    """``args`` as DPTrainingArguments; a missing or plain TrainingArguments is an error (no default privacy)."""
    if args is None:
        raise ValueError(
            "DPTrainer needs `args=DPTrainingArguments(...)` with `target_epsilon` or `noise_multiplier`: there is "
            "no safe default privacy level."
        )
    if isinstance(args, DPTrainingArguments):
        return args
    if isinstance(args, TrainingArguments):
        raise ValueError(
            "DPTrainer got a plain `TrainingArguments`; use `DPTrainingArguments(**args.to_dict(), "
            "target_epsilon=...)` so that the privacy settings are explicit."
        )
    raise TypeError(f"`args` must be DPTrainingArguments, got {type(args).__name__}")


def check_before_init(model, args: DPTrainingArguments, train_dataset, model_init) -> None:
    """Model, data and settings that DPTrainer cannot train privately raise ValueError with what to change."""
    if model_init is not None or model is None:
        raise ValueError("DPTrainer needs `model`; `model_init` (hyperparameter search) is not supported yet.")
    if train_dataset is None:
        raise ValueError("DPTrainer needs `train_dataset`: its size N sets the sample rate and delta.")
    if isinstance(train_dataset, IterableDataset) or not hasattr(train_dataset, "__len__"):
        raise ValueError(
            "DPTrainer needs a `train_dataset` with a length (map-style), because Poisson sampling draws each "
            "example with probability q = L/N. Convert the iterable dataset to a map-style one."
        )
    if args.auto_find_batch_size:
        raise ValueError("`auto_find_batch_size=True` changes the sample rate mid-training; set it to False.")
    if args.n_gpu > 1:
        raise ValueError(
            f"DPTrainer does not support torch.nn.DataParallel ({args.n_gpu} GPUs visible to one process): the "
            "replicas would not run the book-keeping hooks. Set CUDA_VISIBLE_DEVICES to one GPU."
        )
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError(
            "DPTrainer does not support DeepSpeed or FSDP yet: they shard and reduce gradients inside autograd, "
            "which book-keeping bypasses, so training would be wrong. Use plain data parallelism "
            "(`accelerate launch --multi_gpu` or `torchrun`) without a DeepSpeed/FSDP config."
        )
    plan_coverage(model)  # BatchNorm, uncovered trainable parameters: fail now, not at the first step
