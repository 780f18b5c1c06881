"""The modes the probe runs the model in (:mod:`.probe`): eval mode, or training flags with dropout off; random
numbers frozen."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["eval_mode", "frozen_rng", "probe_mode"]


@contextlib.contextmanager
def eval_mode(model: nn.Module, modules: Iterable[nn.Module] | None = None):
    """Every submodule in eval mode (dropout off), each one's own flag restored afterwards. ``modules``: the
    model's ``modules()``, if the caller has just listed them."""
    flags = [(m, m.training) for m in (model.modules() if modules is None else modules)]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


#: Torch functions that drop entries at random in training mode: the identity in a training-like probe.
_DROPOUTS = frozenset(
    {
        torch.nn.functional.dropout,
        torch.nn.functional.dropout1d,
        torch.nn.functional.dropout2d,
        torch.nn.functional.dropout3d,
        torch.nn.functional.alpha_dropout,
        torch.nn.functional.feature_alpha_dropout,
        torch.dropout,
        torch.alpha_dropout,
        torch.feature_dropout,
        torch.feature_alpha_dropout,
    }
)


class _NoDropout(TorchFunctionMode):
    """Dropout as in eval mode (the input unchanged; attention dropout of ``scaled_dot_product_attention`` 0) while
    every module keeps its training flag."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is torch.nn.functional.scaled_dot_product_attention:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            if "dropout_p" in kwargs:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


@contextlib.contextmanager
def probe_mode(model: nn.Module, training_like: bool = False, modules: Iterable[nn.Module] | None = None):
    """The mode the probe runs the model in: :func:`eval_mode`, or (``training_like``) every module's own training
    flag with dropout off (a model whose training forward takes another path than its eval one, e.g. XLNet, which
    returns its memories in eval mode only). Any other random draw of a training-like run differs between the
    sub-batch runs, which then prove nothing for the tensors it touches (refused, never guessed). ``modules``: the
    model's ``modules()``, if the caller has just listed them."""
    if not training_like:
        with eval_mode(model, modules):
            yield
        return
    with _NoDropout():
        yield


@contextlib.contextmanager
def frozen_rng(devices: list[torch.device]):
    """Run code that may draw random numbers without changing what training draws afterwards."""
    cpu = torch.get_rng_state()
    cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda"]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for d, state in cuda:
            torch.cuda.set_rng_state(state, d)
