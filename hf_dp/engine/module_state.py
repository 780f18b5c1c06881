"""The model's modules as the engine found them, after the engine ran the model itself to prove a plan.

Proving a plan runs the model on sub-batches in eval mode and re-runs modules to check rules. A module that keeps
state in its attributes across calls then computes something else in the training forward that follows: nllb-moe's
router sets its ``expert_capacity`` to the token count of every eval-mode call (a value transformers keeps for
training), so after the probe on two examples a training batch of three dropped the tokens past that capacity, tokens
that each example alone would keep (the examples coupled through the drop, which no gradient shows: 0.8x to 5x the
oracle on the routers and experts). :func:`kept_state` puts back every attribute and buffer such a run replaced, and
removes the attributes it added, so the training forward computes what it would have computed without hf_dp.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

from torch import nn

__all__ = ["kept_state"]

_MISSING = object()


def _restore(table: dict, saved: dict) -> None:
    """``table`` (a module's ``__dict__`` or its buffers) back to the objects of ``saved``: replaced entries put back
    by reference, added ones removed (an entry mutated in place, e.g. a dict of hooks, is the same object)."""
    if (
        len(table) == len(saved)
        and all(map(operator.is_, table.values(), saved.values()))
        and all(map(operator.is_, table, saved))
    ):
        return  # the same keys, in the same order, bound to the same objects: nothing to put back
    for key in [k for k in table if k not in saved]:
        del table[key]
    for key, value in saved.items():
        if table.get(key, _MISSING) is not value:
            table[key] = value


@contextlib.contextmanager
def kept_state(model: nn.Module, modules: list[nn.Module] | None = None) -> Iterator[list[nn.Module]]:
    """Every module's attributes and buffers as they were on entry, once the block has run (parameters are left as
    they are). Gives the model's ``modules()`` as they were on entry (``modules``: those, if the caller has just
    listed them)."""
    modules = list(model.modules()) if modules is None else modules
    saved = [(m, dict(m.__dict__), dict(m._buffers)) for m in modules]
    try:
        yield modules
    finally:
        for module, attributes, buffers in saved:
            _restore(module._buffers, buffers)
            _restore(module.__dict__, attributes)
