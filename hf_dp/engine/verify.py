"""Run-time verification of a plan on the first forward pass after it was made (and when train/eval mode changes).

While the real forward pass runs, a :class:`~torch.overrides.TorchFunctionMode` sees every torch function that takes
a trainable parameter with gradients enabled, and checks that some hooked module covering that parameter is running
(DESIGN §4.12: a use nobody covers would silently contribute nothing under ghost differentiation). It also refuses
random numbers drawn inside a module covered by the fallback, whose forward is re-run per example and could not
reproduce them. The cost is one Python call per torch function, on that one forward pass only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import UnsupportedModuleError
from .coverage import HookedModule
from .probe import UseRecorder

__all__ = ["Verification"]

_RANDOM = {
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
# function -> (position of p, name of p, position of training, name of training)
_DROPOUT = {
    F.dropout: (1, "p", 2, "training"),
    F.dropout1d: (1, "p", 2, "training"),
    F.dropout2d: (1, "p", 2, "training"),
    F.dropout3d: (1, "p", 2, "training"),
    F.alpha_dropout: (1, "p", 2, "training"),
    F.feature_alpha_dropout: (1, "p", 2, "training"),
    torch.dropout: (1, "p", 2, "train"),
    torch.alpha_dropout: (1, "p", 2, "train"),
    torch.feature_dropout: (1, "p", 2, "train"),
}


def _arg(args: tuple, kwargs: dict, position: int, name: str, default):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def draws_random_numbers(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers (dropout only with ``p > 0`` in training)."""
    if func in _RANDOM:
        return True
    spec = _DROPOUT.get(func)
    if spec is not None:
        p = _arg(args, kwargs, spec[0], spec[1], 0.5)
        training = _arg(args, kwargs, spec[2], spec[3], True)
        return bool(training) and float(p) > 0
    if func is F.scaled_dot_product_attention:
        return float(_arg(args, kwargs, 4, "dropout_p", 0.0)) > 0
    return False


class _Mode(UseRecorder):
    def __init__(self, verification: Verification) -> None:
        super().__init__(verification.params, verification.on_use, grad_mode_only=True)
        self.verification = verification

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        v = self.verification
        if v.fallback_depth and torch.is_grad_enabled() and draws_random_numbers(func, args, kwargs):
            v.random_in_fallback(func)
        return super().__torch_function__(func, types, args, kwargs)


class Verification:
    """The checks of one verified forward pass: start with :meth:`start`, end with :meth:`stop` (both idempotent).

    :meth:`start` is called from the root model's forward pre-hook, so the root's own call is entered there.

    Args:
        model: the root model.
        hooked: the plan's hooked modules.
        trainable: the trainable parameters.
        names: module names, for messages.
        param_names: parameter names, for messages.
    """

    def __init__(
        self,
        model: nn.Module,
        hooked: list[HookedModule],
        trainable: list[nn.Parameter],
        names: dict[int, str],
        param_names: dict[nn.Parameter, str],
    ) -> None:
        self.model = model
        self.names = names
        self.param_names = param_names
        self.params = {id(p): p for p in trainable}
        self.active: dict[nn.Parameter, int] = {}
        self.fallback_depth = 0
        self.stack: list[nn.Module] = []
        self.covers: dict[int, list[HookedModule]] = {}
        for entry in hooked:
            self.covers.setdefault(id(entry.module), []).append(entry)
        self.handles: list = []
        self.mode: _Mode | None = None

    def start(self) -> None:
        seen: set[int] = {id(self.model)}
        for module in self.model.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            self.handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))
        self._enter(self.model, ())  # the root's call is already in progress
        self.mode = _Mode(self)
        self.mode.__enter__()

    def stop(self) -> None:
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.stack, self.active, self.fallback_depth = [], {}, 0

    def _enter(self, module: nn.Module, args) -> None:
        self.stack.append(module)
        for entry in self.covers.get(id(module), ()):
            for p in entry.params:
                self.active[p] = self.active.get(p, 0) + 1
            self.fallback_depth += entry.is_fallback

    def _leave(self, module: nn.Module, args, output) -> None:
        if not self.stack or self.stack[-1] is not module:
            return
        self.stack.pop()
        for entry in self.covers.get(id(module), ()):
            for p in entry.params:
                self.active[p] -= 1
            self.fallback_depth -= entry.is_fallback

    def _where(self) -> str:
        if not self.stack:
            return "outside any module"
        module = self.stack[-1]
        return f"in the forward pass of `{self.names.get(id(module), '')}` ({type(module).__name__})"

    def on_use(self, p: nn.Parameter, func) -> None:
        if self.active.get(p, 0) > 0:
            return
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        raise UnsupportedModuleError(
            f"Trainable parameter `{self.param_names.get(p, '?')}` is used by `{name}` {self._where()}, where no "
            "hooked module covering it is running: its per-example gradient would be missing. This path was not "
            "seen when hf_dp planned on the first batch (it differs between train and eval mode, or between "
            "batches). Freeze the parameter, or make the model take the same path in both modes."
        )

    def random_in_fallback(self, func) -> None:
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        raise UnsupportedModuleError(
            f"`{name}` draws random numbers {self._where()}, inside a module whose per-example gradients come from "
            "the torch.func fallback, which re-runs its forward per example and cannot reproduce them. Set the "
            "dropout probabilities of that module to 0, or freeze the parameters it covers."
        )
