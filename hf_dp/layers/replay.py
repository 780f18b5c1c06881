"""Random numbers inside a module that the fallback re-runs per example: recorded in the forward, replayed after.

The fallback's per-example gradient re-runs the module's forward on each example alone; dropout (or any random
draw) in that re-run would not be the one the real forward pass used, and the gradient would be wrong. So while a
module covered by the fallback runs in the real forward pass, :class:`RandomRecorder` replaces each dropout by an
explicit mask it keeps (``x * mask / (1 - p)``, as ``torch.nn.functional.dropout`` computes it), computes
``scaled_dot_product_attention`` with dropout by its reference formula with a kept mask, and keeps the output of
every other random draw (``torch.rand`` in stochastic depth, ...). In the re-run of example ``i``,
:class:`RandomReplayer` hands out the same masks and draws, cut to that example's rows.

A recorded tensor is cut along the one dimension whose size is the batch times the re-run's size (the examples'
rows being contiguous there, as in the module's own inputs, which the engine proved); no such dimension, or a
different sequence of draws in the re-run, raises ``UnsupportedModuleError``.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .base import UnsupportedModuleError

__all__ = [
    "ROWS_BY_VALUES",
    "RandomFrame",
    "RandomRecorder",
    "RandomReplayer",
    "draws_random_numbers",
    "refuse_routed_draws",
]

#: Modules (-> their path) that run submodules on rows the data's values choose (an MoE's experts container, found by
#: the engine's probe): a random draw in their forward may cover those rows, in an order no example's re-run sees.
ROWS_BY_VALUES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

#: Random draws whose output is recorded as is.
RANDOM_DRAWS = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.randperm,
    torch.bernoulli,
    torch.multinomial,
    torch.normal,
    torch.poisson,
    Tensor.bernoulli,
    Tensor.bernoulli_,
    Tensor.uniform_,
    Tensor.normal_,
    Tensor.random_,
    Tensor.exponential_,
    Tensor.geometric_,
    Tensor.cauchy_,
    Tensor.log_normal_,
    Tensor.multinomial,
}
# dropout functions -> (position of p, name of p, position of training, name of training)
DROPOUTS = {
    F.dropout: (1, "p", 2, "training"),
    F.dropout1d: (1, "p", 2, "training"),
    F.dropout2d: (1, "p", 2, "training"),
    F.dropout3d: (1, "p", 2, "training"),
    torch.dropout: (1, "p", 2, "train"),
    torch.feature_dropout: (1, "p", 2, "train"),
}
_CHANNEL_DROPOUTS = {F.dropout1d, F.dropout2d, F.dropout3d, torch.feature_dropout}
_UNREPLAYABLE = {F.alpha_dropout, F.feature_alpha_dropout, torch.alpha_dropout, torch.feature_alpha_dropout}


def _arg(args: tuple, kwargs: dict, position: int, name: str, default):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _dropout_p(func, args: tuple, kwargs: dict) -> float | None:
    """``p`` if this call is a dropout that draws random numbers (``p > 0`` in training), else ``None``."""
    spec = DROPOUTS.get(func)
    if spec is None or not _arg(args, kwargs, spec[2], spec[3], True):
        return None
    p = float(_arg(args, kwargs, spec[0], spec[1], 0.5))
    return p if p > 0 else None


def _sdpa_p(func, args: tuple, kwargs: dict) -> float | None:
    if func is not F.scaled_dot_product_attention:
        return None
    p = float(_arg(args, kwargs, 4, "dropout_p", 0.0))
    return p if p > 0 else None


def draws_random_numbers(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers (dropout only with ``p > 0`` in training)."""
    if func in RANDOM_DRAWS or func in _UNREPLAYABLE:
        return True
    return _dropout_p(func, args, kwargs) is not None or _sdpa_p(func, args, kwargs) is not None


def _mask_shape(func, x: Tensor) -> tuple[int, ...]:
    if func in _CHANNEL_DROPOUTS:  # one draw per channel: [N, C, 1, ...]
        return (*x.shape[:2], *([1] * (x.dim() - 2)))
    return tuple(x.shape)


def _apply(x: Tensor, mask: Tensor, p: float) -> Tensor:
    if p >= 1:
        return x * 0
    return x * mask.to(x.dtype) / (1 - p)


def _attention(args: tuple, kwargs: dict, mask_for) -> Tensor:
    """``scaled_dot_product_attention`` by its reference formula, with the dropout mask ``mask_for(shape)``."""
    q, k, v = args[:3]
    attn_mask = _arg(args, kwargs, 3, "attn_mask", None)
    p = float(_arg(args, kwargs, 4, "dropout_p", 0.0))
    is_causal = bool(_arg(args, kwargs, 5, "is_causal", False))
    scale = _arg(args, kwargs, 6, "scale", None)
    if _arg(args, kwargs, 7, "enable_gqa", False) and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = scores.softmax(-1)
    return _apply(weights, mask_for(tuple(weights.shape)), p) @ v


def refuse_routed_draws(module: nn.Module) -> None:
    """Raise if ``module`` (whose forward drew random numbers) is or holds a module of :data:`ROWS_BY_VALUES`: a draw
    over routed rows (token dropout on an expert's rows) has them in the router's order, which cutting it along a
    dimension of the batch's size cannot undo (its sizes may even match by chance: silently wrong)."""
    where = next((ROWS_BY_VALUES[m] for m in module.modules() if m in ROWS_BY_VALUES), None)
    if where is not None:
        raise UnsupportedModuleError(
            f"`{where}` runs modules on rows chosen by the data's values (an MoE's experts) and its forward pass draws "
            "random numbers (dropout in training, e.g. the experts' token dropout): hf_dp cannot replay them per "
            "example. Set those dropout probabilities to 0 (e.g. `moe_token_dropout`), or freeze the parameters "
            f"used inside `{where}`."
        )


def _keep(shape: tuple[int, ...], p: float, like: Tensor) -> Tensor:
    """A kept mask drawn as torch's own (non-fused) dropout draws it, ``bernoulli_(1 - p)`` on a tensor of the input's
    dtype: on CPU the forward pass draws what it would draw without hf_dp, and training's random stream is the same."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - p).bool()


class RandomFrame(list):
    """The draws recorded for one call in progress, and the path of its module in the model (for refusals)."""

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name


class RandomRecorder(TorchFunctionMode):
    """Records the random draws of the fallback-covered calls in progress (:attr:`frames`, innermost last)."""

    def __init__(self, on_draw=None) -> None:
        super().__init__()
        self.frames: list[list[tuple[str, Tensor]]] = []
        self.on_draw = on_draw  # called at every recorded draw (the engine checks activation checkpointing there)

    def _record(self, kind: str, value: Tensor) -> None:
        if self.on_draw is not None:
            self.on_draw()
        for frame in self.frames:
            frame.append((kind, value))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.frames or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if func in _UNREPLAYABLE:
            where = getattr(self.frames[-1], "name", "") or "a module"
            raise UnsupportedModuleError(
                f"`{getattr(func, '__name__', func)}` draws random numbers inside `{where}`, covered by the torch.func "
                "fallback, in a way hf_dp cannot replay per example. Set its probability to 0 or freeze the module."
            )
        p = _dropout_p(func, args, kwargs)
        if p is not None:
            x = args[0] if args else kwargs["input"]
            mask = _keep(_mask_shape(func, x), p, x)
            self._record("mask", mask)
            return _apply(x, mask, p)
        p = _sdpa_p(func, args, kwargs)
        if p is not None:

            def mask_for(shape):
                mask = _keep(shape, p, args[0])
                self._record("mask", mask)
                return mask

            return _attention(args, kwargs, mask_for)
        out = func(*args, **kwargs)
        if func in RANDOM_DRAWS:
            self._record("draw", out)
        return out


class RandomReplayer(TorchFunctionMode):
    """Replays ``records`` (from :class:`RandomRecorder`) in the re-run of example ``example`` of ``batch_size``."""

    def __init__(self, records: list[tuple[str, Tensor]], batch_size: int, example: int, module_name: str) -> None:
        super().__init__()
        self.records = records
        self.batch_size = batch_size
        self.example = example
        self.module_name = module_name
        self.next = 0

    def _take(self, kind: str, shape: tuple[int, ...]) -> Tensor:
        if self.next >= len(self.records) or self.records[self.next][0] != kind:
            raise self._mismatch()
        recorded = self.records[self.next][1]
        self.next += 1
        return _cut(recorded, shape, self.batch_size, self.example, self._mismatch)

    def _mismatch(self) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            f"The per-example re-run of `{self.module_name}` draws different random numbers than its forward pass "
            "did, so hf_dp cannot replay them. Set its dropout probabilities to 0 or freeze its parameters."
        )

    def finish(self) -> None:
        if self.next != len(self.records):
            raise self._mismatch()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p = _dropout_p(func, args, kwargs)
        if p is not None:
            x = args[0] if args else kwargs["input"]
            return _apply(x, self._take("mask", _mask_shape(func, x)), p)
        p = _sdpa_p(func, args, kwargs)
        if p is not None:
            return _attention(args, kwargs, lambda shape: self._take("mask", shape))
        out = func(*args, **kwargs)
        if func in RANDOM_DRAWS:
            replayed = self._take("draw", tuple(out.shape))
            if func.__name__.endswith("_") and isinstance(args[0], Tensor):  # in-place draw: write the recorded one
                with torch.no_grad():
                    args[0].copy_(replayed)
                return args[0]
            return replayed
        return out


def _cut(recorded: Tensor, shape: tuple[int, ...], batch_size: int, example: int, error) -> Tensor:
    """The rows of ``example`` in ``recorded``, which holds ``batch_size`` examples of ``shape`` along one dimension;
    ``recorded`` itself where the re-run draws the shape the forward drew: a draw for the whole call, not per example
    (peft's LyCORIS ``torch.rand(1) > module_dropout``, which keeps or drops the adapter for the whole batch, and its
    rank-dropout mask over the output rows), which every example's re-run must see as the forward drew it."""
    if tuple(recorded.shape) == shape:
        return recorded
    if recorded.dim() != len(shape):
        raise error()
    dims = [
        d
        for d in range(recorded.dim())
        if recorded.shape[d] == batch_size * shape[d]
        and all(recorded.shape[j] == shape[j] for j in range(recorded.dim()) if j != d)
    ]
    if len(dims) != 1:
        raise error()
    d, k = dims[0], shape[dims[0]]
    return recorded.narrow(d, example * k, k)
