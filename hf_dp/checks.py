"""Checks DPTrainer runs before ``Trainer.__init__``: settings that would break the guarantee fail here, not at
the first step."""

from __future__ import annotations

from torch.utils.data import IterableDataset
from transformers import TrainingArguments

from .arguments import DPArgumentsMixin, DPTrainingArguments
from .engine import plan_coverage
from .fsdp import is_fsdp2

__all__ = ["check_before_init", "check_fsdp", "check_train_dataset", "dp_arguments"]


def dp_arguments(args: TrainingArguments | None, expected: type = DPTrainingArguments) -> DPArgumentsMixin:
    """``args`` as DP arguments of class ``expected``; a missing or plain TrainingArguments is an error (there is no
    default privacy level)."""
    name = expected.__name__
    if args is None:
        raise ValueError(
            f"This trainer needs `args={name}(...)` with `target_epsilon` or `noise_multiplier`: there is no safe "
            "default privacy level."
        )
    if isinstance(args, DPArgumentsMixin):
        if not isinstance(args, expected):
            raise TypeError(f"`args` must be {name}, got {type(args).__name__}")
        return args
    if isinstance(args, TrainingArguments):
        raise ValueError(
            f"Got a plain `{type(args).__name__}`; use `{name}(**args.to_dict(), target_epsilon=...)` so that the "
            "privacy settings are explicit."
        )
    raise TypeError(f"`args` must be {name}, got {type(args).__name__}")


def check_train_dataset(train_dataset) -> int:
    """``N`` of a training set DP training can sample from; ValueError with what to do otherwise."""
    if train_dataset is None:
        raise ValueError(
            "`train()` needs `train_dataset`: its size N sets the sample rate and delta. Pass it to the trainer "
            "(it may be omitted only for `evaluate()`/`predict()`)."
        )
    if isinstance(train_dataset, IterableDataset) or not hasattr(train_dataset, "__len__"):
        raise ValueError(
            "DPTrainer needs a `train_dataset` with a length (map-style), because Poisson sampling draws each "
            "example with probability q = L/N. Convert the iterable dataset to a map-style one."
        )
    if len(train_dataset) == 0:
        raise ValueError("`train_dataset` is empty.")
    return len(train_dataset)


def check_before_init(model, args: DPArgumentsMixin, train_dataset, model_init) -> None:
    """Model, data and settings that DP training cannot handle privately raise ValueError with what to change."""
    if model_init is not None or model is None:
        raise ValueError("DPTrainer needs `model`; `model_init` (hyperparameter search) is not supported yet.")
    if train_dataset is not None:
        check_train_dataset(train_dataset)
    if args.n_gpu > 1:
        raise ValueError(
            f"DPTrainer does not support torch.nn.DataParallel ({args.n_gpu} GPUs visible to one process): the "
            "replicas would not run the book-keeping hooks. Set CUDA_VISIBLE_DEVICES to one GPU."
        )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "DPTrainer does not support DeepSpeed: ZeRO reduces and partitions gradients inside autograd hooks, which "
            "book-keeping bypasses, so training would be wrong. Shard with FSDP2 instead (`fsdp=True`, "
            '`fsdp_config={"version": 2, ...}`), or use plain data parallelism.'
        )
    if getattr(args, "fsdp", None):
        check_fsdp(args)
    if is_fsdp2(model):
        raise ValueError(
            "The model was passed to DPTrainer already sharded by `fully_shard`. Pass the plain model and let the "
            'Trainer shard it (`fsdp=True`, `fsdp_config={"version": 2, ...}`).'
        )
    plan_coverage(model)  # BatchNorm, uncovered trainable parameters: fail now, not at the first step


def check_fsdp(args: DPArgumentsMixin) -> None:
    """FSDP settings DPTrainer can train with (FSDP2, gradients on the device, fp32 or bf16); ValueError otherwise."""
    config = dict(args.fsdp_config or {})
    version = int(config.get("version", 2))
    if version != 2:
        raise ValueError(
            f"DPTrainer supports FSDP2 only (got `fsdp_config['version'] = {version}`): FSDP1 flattens parameters "
            "and reduces their gradients inside autograd. Set `fsdp_config['version'] = 2`."
        )
    if str(config.get("cpu_offload", False)).lower() == "true":
        raise ValueError(
            "DPTrainer does not support FSDP CPU offloading (`cpu_offload`/`offload`): the clipped sums are "
            "reduce-scattered into gradients on the device. Turn it off."
        )
    if str(config.get("activation_checkpointing", False)).lower() == "true":
        raise ValueError(
            "DPTrainer does not support FSDP's own activation checkpointing (`fsdp_config['activation_checkpointing']`"
            ") yet. Turn it off."
        )
    if getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False):
        raise ValueError("DPTrainer does not support activation checkpointing together with FSDP2 yet. Turn one off.")
    if args.fp16:
        raise ValueError(
            "DPTrainer does not support fp16 with FSDP2 yet: accelerate's sharded loss scaling and hf_dp's noised "
            "overflow policy (hf_dp.loss_scale) are not wired together. Use `bf16=True`, or fp16 without FSDP."
        )
