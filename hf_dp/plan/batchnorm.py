"""BatchNorm converted, before the plan, into layers that have a per-example gradient: :func:`replace_batchnorm`.

BatchNorm has no per-example gradient in training mode (each example is normalised with the batch's statistics), so
the engine refuses it (:mod:`hf_dp.engine.coverage`) and its message names this call. Two conversions, as Opacus's
``ModuleValidator.fix`` offers the first:

* ``"group_norm"``: ``nn.GroupNorm`` with Opacus's group count (:func:`default_num_groups`) and the BatchNorm's affine
  weight and bias; each example is normalised over its own channel groups (the running statistics are dropped);
* ``"frozen"``: :class:`FrozenBatchNorm`, BatchNorm in eval mode for good: a fixed per-channel normalisation by the
  running statistics (buffers, never updated) followed by the trainable affine map, whose per-example gradients the
  engine's torch.func fallback computes exactly.

Imports nothing of hf_dp: a model is converted before anything of the plan sees it.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

logger = logging.getLogger(__name__)

__all__ = ["BATCHNORM_STRATEGIES", "FrozenBatchNorm", "default_num_groups", "replace_batchnorm"]

#: The conversions :func:`replace_batchnorm` offers.
BATCHNORM_STRATEGIES = ("group_norm", "frozen")

#: The most groups :func:`default_num_groups` picks (the *Group Normalization* paper's default, as in Opacus).
MAX_GROUPS = 32


def default_num_groups(num_channels: int) -> int:
    """The GroupNorm group count Opacus's ``ModuleValidator.fix`` picks for ``num_channels`` channels: the largest power
    of two that divides ``num_channels``, at most 32 (``gcd(32, C)``: 32 for 64 channels, 16 for 48, 4 for 12, 1 for 3).
    """
    groups = 1
    while groups < MAX_GROUPS and num_channels % (2 * groups) == 0:
        groups *= 2
    return groups


class FrozenBatchNorm(nn.Module):
    """A BatchNorm layer in eval mode for good, in training as in evaluation:
    ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias`` per channel (dimension 1 of the input).

    The running statistics are buffers that are never updated, so each example's output depends on that example alone
    and ``weight`` and ``bias`` (trainable if they were) have per-example gradients. The state dict has BatchNorm's
    keys (``weight``, ``bias``, ``running_mean``, ``running_var``, ``num_batches_tracked``), so a checkpoint of a
    converted model loads into the original class, and :func:`replace_batchnorm` with ``strategy="frozen"`` restores it.

    Args:
        num_features (`int`): the number of channels ``C``.
        eps (`float`, *optional*, defaults to 1e-5): added to the running variance.
        affine (`bool`, *optional*, defaults to `True`): with a weight and a bias (ones and zeros until loaded).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.affine = affine
        self.weight = nn.Parameter(torch.ones(num_features, **factory)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features, **factory)) if affine else None
        self.register_buffer("running_mean", torch.zeros(num_features, **factory))
        self.register_buffer("running_var", torch.ones(num_features, **factory))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))

    @classmethod
    def from_batchnorm(cls, module: _BatchNorm) -> FrozenBatchNorm:
        """The eval-mode map of ``module`` (its running statistics, eps, weight and bias, copied; ``requires_grad``
        kept)."""
        stats = module.running_mean
        frozen = cls(module.num_features, module.eps, module.affine, device=stats.device, dtype=stats.dtype)
        with torch.no_grad():
            frozen.running_mean.copy_(module.running_mean)
            frozen.running_var.copy_(module.running_var)
            frozen.num_batches_tracked.copy_(module.num_batches_tracked)
        _copy_affine(module, frozen)
        return frozen

    def forward(self, input: Tensor) -> Tensor:
        return F.batch_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            training=False,
            momentum=0.0,
            eps=self.eps,
        )

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.affine}"


def _copy_affine(source: _BatchNorm, target: nn.Module) -> None:
    """``source``'s weight and bias into ``target``'s (same shape), with their ``requires_grad``."""
    if not source.affine:
        return
    with torch.no_grad():
        for name in ("weight", "bias"):
            getattr(target, name).copy_(getattr(source, name))
            getattr(target, name).requires_grad_(getattr(source, name).requires_grad)


def _to_group_norm(module: _BatchNorm, num_groups: int | None) -> nn.GroupNorm:
    groups = num_groups or default_num_groups(module.num_features)
    reference = module.weight if module.affine else module.running_mean
    factory = {"device": reference.device, "dtype": reference.dtype} if reference is not None else {}
    norm = nn.GroupNorm(groups, module.num_features, eps=module.eps, affine=module.affine, **factory)
    _copy_affine(module, norm)
    return norm


def _check_convertible(name: str, module: _BatchNorm, strategy: str, num_groups: int | None) -> None:
    """ValueError, naming the module, where ``module`` cannot be converted with ``strategy``."""
    where = f"`{name}` ({type(module).__name__})"
    if any(is_lazy(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
        raise ValueError(f"{where} is a lazy BatchNorm not yet initialised: run one forward pass before converting it.")
    if strategy == "group_norm" and num_groups is not None and module.num_features % num_groups:
        raise ValueError(
            f"num_groups={num_groups} does not divide the {module.num_features} channels of {where}; leave "
            "`num_groups=None` for a group count per layer (the largest power of two dividing C, at most 32)."
        )
    if strategy == "frozen" and module.running_mean is None:
        raise ValueError(
            f"{where} has no running statistics (`track_running_stats=False`): it normalises with the batch's "
            "statistics even in eval mode, so there is nothing to freeze. Use `strategy='group_norm'`."
        )


def _check_arguments(model: nn.Module, strategy: str, num_groups: int | None) -> None:
    if strategy not in BATCHNORM_STRATEGIES:
        raise ValueError(f"strategy must be one of {BATCHNORM_STRATEGIES}, got {strategy!r}")
    if num_groups is not None and (strategy != "group_norm" or isinstance(num_groups, bool) or num_groups < 1):
        raise ValueError(
            f"num_groups must be a positive int, and is for strategy='group_norm' only; got {num_groups!r}"
        )
    if isinstance(model, _BatchNorm):
        raise ValueError(
            "The model itself is a BatchNorm layer: convert a model that holds it (nothing to replace in)."
        )


def replace_batchnorm(model: nn.Module, *, strategy: str = "group_norm", num_groups: int | None = None) -> nn.Module:
    """Replace every BatchNorm layer of ``model`` (``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``, any ``_BatchNorm``)
    by a layer with per-example gradients, so that DP training can clip each example's gradient.

    Call it on the loaded model, before `DPTrainer` or `BookKeepingClipper` (both refuse BatchNorm and name this call).
    The model is converted **in place** and returned (Opacus's ``ModuleValidator.fix`` returns a converted copy); a
    layer shared by several parents gets one shared replacement. Calling it again replaces nothing.

    - `"group_norm"` (Opacus's conversion, which starts from ones and zeros): `nn.GroupNorm(num_groups, C, eps, affine)`
      per layer, starting as the same affine map (weight and bias copied) of inputs normalised per example over
      channel groups. The running statistics are dropped, so the outputs change: fine-tune the model after
      converting. Trains: every GroupNorm's weight and bias (those that trained before).
    - `"frozen"`: :class:`FrozenBatchNorm`, BatchNorm in eval mode for good: the model computes what it computed in
      eval mode, exactly, in training too; the running statistics are never updated. Trains: every layer's weight and
      bias (a per-channel affine map; those that trained before); freeze them with ``requires_grad_(False)``.

    Args:
        model (`nn.Module`): the model, e.g. a `ResNetForImageClassification` or `SegformerForSemanticSegmentation`.
        strategy (`str`, *optional*, defaults to `"group_norm"`): `"group_norm"` or `"frozen"`.
        num_groups (`int`, *optional*): the group count of every GroupNorm (it must divide each layer's channel
            count); by default, per layer, the largest power of two that divides C, at most 32, as Opacus picks it.

    Returns:
        `nn.Module`: ``model`` itself, with no BatchNorm left. Its class and config are unchanged: loading a saved
        converted model builds BatchNorm again, so call `replace_batchnorm` again (same arguments) after loading.

    Raises:
        ValueError: an unknown strategy; `num_groups` not dividing a layer's channels, or with `"frozen"`; `"frozen"`
            on a BatchNorm without running statistics; a lazy BatchNorm not yet run; ``model`` a BatchNorm itself.
            Nothing is changed when it raises.

    Example:
        ```python
        import hf_dp
        from transformers import ResNetForImageClassification

        model = ResNetForImageClassification.from_pretrained("microsoft/resnet-50")
        model = hf_dp.replace_batchnorm(model)  # BatchNorm2d(C) -> GroupNorm(32, C); or strategy="frozen"
        trainer = hf_dp.DPTrainer(model=model, args=training_args, train_dataset=train_dataset)
        ```
    """
    _check_arguments(model, strategy, num_groups)
    found = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, _BatchNorm)]
    for name, module in found:
        _check_convertible(name, module, strategy, num_groups)
    replaced = _replace(model, found, strategy, num_groups)
    kinds = Counter(type(m).__name__ for m in replaced)
    logger.info(
        "hf_dp: replaced %d BatchNorm layer(s)%s with %s (strategy=%r).",
        len(replaced),
        f" ({', '.join(f'{k}: {n}' for k, n in sorted(kinds.items()))})" if kinds else "",
        "GroupNorm" if strategy == "group_norm" else "FrozenBatchNorm (running statistics fixed, affine trainable)",
        strategy,
    )
    return model


def _replace(
    model: nn.Module, found: list[tuple[str, _BatchNorm]], strategy: str, num_groups: int | None
) -> list[_BatchNorm]:
    """Put each BatchNorm's replacement where it sits (one replacement for a layer at several places, in the
    BatchNorm's training mode); the BatchNorm layers replaced, once each."""
    replacements: dict[int, tuple[_BatchNorm, nn.Module]] = {}
    for name, module in found:
        if id(module) not in replacements:
            if strategy == "group_norm":
                new = _to_group_norm(module, num_groups)
            else:
                new = FrozenBatchNorm.from_batchnorm(module)
            replacements[id(module)] = (module, new.train(module.training))
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, replacements[id(module)][1])
    return [old for old, _ in replacements.values()]
