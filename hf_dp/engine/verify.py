"""Run-time verification of a plan on the first forward pass after it was made (and when train/eval mode changes).

While the real forward pass runs, a :class:`~torch.overrides.TorchFunctionMode` sees every torch function that takes
a trainable parameter with gradients enabled, and checks that some hooked module covering that parameter is running
(DESIGN §4.12: a use nobody covers would silently contribute nothing under ghost differentiation). The cost is one
Python call per torch function, on that one forward pass only. (Random draws inside modules covered by the fallback
are recorded and replayed every step: :mod:`hf_dp.layers.replay`.)
"""

from __future__ import annotations

import sys

from torch import nn

from ..layers import UnsupportedModuleError
from .coverage import HookedModule
from .probe import UseRecorder

__all__ = ["Verification"]


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
        self.stack: list[nn.Module] = []
        self.covers: dict[int, list[HookedModule]] = {}
        for entry in hooked:
            self.covers.setdefault(id(entry.module), []).append(entry)
        self.handles: list = []
        self.mode: UseRecorder | None = None

    def start(self) -> None:
        # Only the covering modules change what `on_use` accepts: they alone are hooked (the other modules run
        # without hooks, as in every later forward pass); the module a refused use ran in is found when refusing.
        for entries in self.covers.values():
            module = entries[0].module
            if module is self.model:
                continue
            self.handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))
        self._enter(self.model, ())  # the root's call is already in progress
        self.mode = UseRecorder(self.params, self.on_use, grad_mode_only=True)
        self.mode.__enter__()

    def stop(self) -> None:
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.stack, self.active = [], {}

    def _enter(self, module: nn.Module, args) -> None:
        self.stack.append(module)
        for entry in self.covers.get(id(module), ()):
            for p in entry.params:
                self.active[p] = self.active.get(p, 0) + 1

    def _leave(self, module: nn.Module, args, output) -> None:
        if not self.stack or self.stack[-1] is not module:
            return
        self.stack.pop()
        for entry in self.covers.get(id(module), ()):
            for p in entry.params:
                self.active[p] -= 1

    def _where(self) -> str:
        module = _innermost_call(self.names)
        if module is None:
            return "outside any module"
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


def _innermost_call(names: dict[int, str]) -> nn.Module | None:
    """The innermost module of the model (``names``: its modules) whose call is in progress on this thread."""
    codes = (nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and id(module) in names:
                return module
        frame = frame.f_back
    return None
