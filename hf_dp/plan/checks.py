"""Checks DPTrainer runs before ``Trainer.__init__``: settings that would break the guarantee fail here, not at
the first step."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import IterableDataset
from transformers import TrainingArguments

from ..arguments import DPArgumentsMixin, DPTrainingArguments
from ..engine import plan_coverage
from ..sampling.batch_checks import check_collator
from ..step.fsdp import is_fsdp2

__all__ = [
    "BACKWARD_STEPPING_OPTIMIZER_CLASSES",
    "backward_stepping_optims",
    "check_accelerator",
    "check_before_init",
    "check_fsdp",
    "check_optimizer",
    "check_optimizer_settings",
    "check_post_accumulate_grad_hooks",
    "check_train_dataset",
    "check_train_start",
    "dp_arguments",
]

#: Optimizer classes that update the weights inside the backward pass (LOMO's fused backward) or whose ``step()``
#: is a no-op because the real steps run in post-accumulate-grad hooks (transformers' layer-wise GaLore/APOLLO).
BACKWARD_STEPPING_OPTIMIZER_CLASSES = ("Lomo", "AdaLomo", "LayerWiseDummyOptimizer")


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
        raise ValueError(
            "`train_dataset` is empty (0 examples): there is nothing to train on, and no sample rate q = L/N. Check "
            "the data loading and filtering (e.g. a `max_length` filter or a split that removed every row), and pass "
            "the non-empty training set as `train_dataset`."
        )
    return len(train_dataset)


def check_before_init(
    model,
    args: DPArgumentsMixin,
    train_dataset,
    model_init,
    *,
    data_collator=None,
    optimizers=(None, None),
    optimizer_cls_and_kwargs=None,
) -> None:
    """Model, data and settings that DP training cannot handle privately raise ValueError with what to change."""
    check_optimizer_settings(args)
    check_accelerator(args.accelerator_config, "`accelerator_config`")
    check_collator(data_collator)
    optimizer = (optimizers or (None, None))[0]
    if optimizer is not None:
        check_optimizer(optimizer, "the optimizer passed in `optimizers`")
        check_post_accumulate_grad_hooks(None, optimizer)
    if optimizer_cls_and_kwargs is not None:
        check_optimizer(optimizer_cls_and_kwargs[0], "the class in `optimizer_cls_and_kwargs`")
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
            "overflow policy (hf_dp.step.loss_scale) are not wired together. Use `bf16=True`, or fp16 without FSDP."
        )


def backward_stepping_optims() -> list[str]:
    """The ``optim`` values DPTrainer refuses: LOMO/AdaLomo (update inside the backward) and every layer-wise
    optimizer transformers knows (``*_layerwise``: updates in post-accumulate-grad hooks)."""
    from transformers.training_args import OptimizerNames

    names = {"lomo", "adalomo", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise"}
    names |= {o.value for o in OptimizerNames if o.value.endswith("layerwise") or "lomo" in o.value}
    return sorted(names)


def _optim_name(optim: Any) -> str:
    return str(getattr(optim, "value", optim)).lower()


def check_optimizer_settings(args: DPArgumentsMixin) -> None:
    """``optim`` values that step inside the backward, and Liger kernels, raise ValueError with what to set."""
    optim = _optim_name(args.optim)
    refused = backward_stepping_optims()
    if optim in refused or optim.endswith("layerwise"):
        raise ValueError(
            f"`optim={optim!r}` is not supported by DPTrainer: it updates the weights inside the backward pass (LOMO, "
            "AdaLomo) or in post-accumulate-grad hooks (layer-wise optimizers), before the clipped per-example "
            "gradients of the logical batch are summed and noised, so it would train on un-noised gradients (or not "
            f"at all). Refused: {refused}. Use an optimizer that steps once per logical batch, e.g. `adamw_torch`, "
            "`sgd`, `adafactor`, or the non-layer-wise `galore_adamw`."
        )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "`use_liger_kernel=True` is not supported by DPTrainer yet: Liger's fused linear cross-entropy never "
            "materialises the per-example logits, so the per-example losses and their clipping cannot be exact. Set "
            "`use_liger_kernel=False`."
        )


def check_optimizer(optimizer: Any, source: str) -> None:
    """An optimizer instance or class that steps inside the backward pass raises ValueError."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, type):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    names = {c.__name__ for c in cls.__mro__}
    found = sorted(names.intersection(BACKWARD_STEPPING_OPTIMIZER_CLASSES))
    if found:
        raise ValueError(
            f"{source} is a `{cls.__name__}`, which updates the weights inside the backward pass (or in "
            "post-accumulate-grad hooks), before the clipped per-example gradients are summed and noised. DPTrainer "
            f"refuses {list(BACKWARD_STEPPING_OPTIMIZER_CLASSES)} and the `optim` values {backward_stepping_optims()}. "
            "Use an optimizer that steps once per logical batch (`torch.optim.AdamW`, `SGD`, ...)."
        )


def _has_post_accumulate_grad_hooks(p) -> bool:
    return bool(getattr(p, "_post_accumulate_grad_hooks", None))


def check_post_accumulate_grad_hooks(model: nn.Module | None, optimizer: Any = None) -> None:
    """A parameter of ``model`` or of ``optimizer`` with post-accumulate-grad hooks raises ValueError: such hooks
    (layer-wise optimizers, gradient averaging) never see the privatised gradient, because book-keeping writes
    ``p.grad`` outside autograd, or they would act on un-noised sums."""
    hooked: list[str] = []
    if model is not None:
        hooked += [name for name, p in model.named_parameters() if _has_post_accumulate_grad_hooks(p)]
    while optimizer is not None and hasattr(optimizer, "optimizer") and not hasattr(optimizer, "param_groups"):
        optimizer = optimizer.optimizer
    if optimizer is not None and not hooked:
        for group in getattr(optimizer, "param_groups", []):
            for i, p in enumerate(group.get("params", [])):
                if _has_post_accumulate_grad_hooks(p):
                    hooked.append(f"optimizer parameter {i} of shape {tuple(p.shape)}")
    if hooked:
        shown = ", ".join(hooked[:5]) + (f" and {len(hooked) - 5} more" if len(hooked) > 5 else "")
        raise ValueError(
            f"Parameters have post-accumulate-grad hooks registered ({shown}): a hook that steps or changes the "
            "gradient inside the backward pass (layer-wise optimizers such as `galore_adamw_layerwise`, LOMO, "
            "custom `register_post_accumulate_grad_hook` code) never sees the noised gradient of the logical batch. "
            "Remove the hooks (or build the model and optimizer without them) before DP training; `optim` values "
            f"refused for this reason: {backward_stepping_optims()}."
        )


def check_accelerator(config: Any, source: str) -> None:
    """accelerate settings that merge, split, duplicate or pad the Poisson micro-batches raise ValueError.
    ``config``: an ``AcceleratorConfig``, a dict, or an ``Accelerator``/``DataLoaderConfiguration``.

    ``even_batches`` is not refused: it pads only in accelerate's ``BatchSamplerShard`` when it shards batches
    across processes, which DPTrainer makes a passthrough (its Poisson sampler is already rank-aware)."""
    if config is None:
        return

    def get(name: str):
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    if get("dispatch_batches"):
        raise ValueError(
            f"{source} has `dispatch_batches=True`, which DPTrainer does not support: accelerate's dispatcher joins "
            "the micro-batches of all processes and pads the epoch's last batch with examples from its start, so an "
            "example can appear twice in a logical batch (sensitivity 2C) and empty Poisson micro-batches break it. "
            'Set `accelerator_config={"dispatch_batches": False}` (each process then reads its own share of the '
            "Poisson batch)."
        )
    if get("split_batches"):
        raise ValueError(
            f"{source} has `split_batches=True`, which DPTrainer does not support: Poisson micro-batches have random "
            "sizes and are already shared between processes by hf_dp's sampler; accelerate's splitting would cut or "
            'pad them. Set `accelerator_config={"split_batches": False}`.'
        )


def check_train_start(trainer) -> None:
    """At ``train()`` start, before any privacy is spent: the checks of :func:`check_before_init` that can change
    after the trainer was built (arguments, accelerator, collator, optimizer), and post-accumulate-grad hooks on the
    model or the optimizer."""
    args = trainer.args
    check_optimizer_settings(args)
    check_accelerator(args.accelerator_config, "`accelerator_config`")
    accelerator = getattr(trainer, "accelerator", None)
    check_accelerator(getattr(accelerator, "dataloader_config", None), "The Trainer's accelerator")
    check_collator(trainer.data_collator)
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        check_optimizer(optimizer, "The trainer's optimizer")
    check_post_accumulate_grad_hooks(trainer.model, optimizer)
