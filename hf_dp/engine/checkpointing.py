"""Activation checkpointing: where a hooked call runs (a checkpointed forward, its recomputation, or neither).

Non-reentrant ``torch.utils.checkpoint`` (the transformers default, ``use_reentrant=False``) runs a region's forward
with saved-tensor hooks that keep nothing, and recomputes the region inside the backward pass when autograd first
unpacks one of its saved tensors; autograd then runs the original graph. Book-keeping follows it:

* in the checkpointed forward a hooked call records its use (layout, parameters, output hook on the original output)
  but keeps no input: holding it would undo the memory saving;
* in the recomputation the same call runs again, in the same order: its inputs are book-kept into the recorded use
  (the k-th hooked call of a region's recomputation is the k-th of its forward), and an output gradient that arrived
  before the recomputation waits for them. Parameters are kept out of autograd during a recomputation as in the
  forward (ghost differentiation), so that it saves the same tensors.

Reentrant checkpointing (``use_reentrant=True``) runs the region without gradients and backpropagates a second graph
built in the backward pass; it is refused with what to set.

Which region a call belongs to is read from the saved-tensor hooks on top of autograd's stack (those of
``torch.utils.checkpoint``'s ``_checkpoint_hook`` and ``_recomputation_hook``): :func:`checkpoint_region`. If this
torch does not expose them, :data:`CHECKPOINTING_SUPPORTED` is false and checkpointing is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = [
    "CHECKPOINTING_SUPPORTED",
    "checkpoint_region",
    "in_backward",
    "own_saved_tensors",
    "reentrant_checkpointing",
]

_top_hooks = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)

#: Whether this torch lets the engine tell a checkpointed forward and a recomputation apart.
CHECKPOINTING_SUPPORTED: bool = _top_hooks is not None and _graph_task_id is not None


def _closure(fn, name: str):
    fn = getattr(fn, "__wrapped__", fn)  # torch._dynamo.disable wraps the recomputation's pack hook
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def checkpoint_region() -> tuple[str, Any] | None:
    """``("forward", frame)`` inside the forward of a non-reentrant checkpoint region, ``("recompute", frame)``
    inside its recomputation (``frame``: the region's ``_CheckpointFrame``), ``None`` elsewhere."""
    if _top_hooks is None:
        return None
    hooks = _top_hooks(False)
    if not hooks:
        return None
    pack = hooks[0]
    qualname = getattr(pack, "__qualname__", "")
    if qualname.startswith("_checkpoint_hook."):
        frame = _closure(pack, "frame")
        return None if frame is None else ("forward", frame)
    if qualname.startswith("_recomputation_hook."):
        ref = _closure(pack, "target_frame_ref")
        frame = ref() if ref is not None else None
        return None if frame is None else ("recompute", frame)
    return None


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread."""
    return _graph_task_id is not None and _graph_task_id() != -1


def reentrant_checkpointing(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` (transformers' ``gradient_checkpointing`` flag on) whose checkpoint function
    is reentrant: ``torch.utils.checkpoint.checkpoint`` without ``use_reentrant=False`` (its default is reentrant)."""
    found = []
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is not True:
            continue
        fn = getattr(module, "_gradient_checkpointing_func", None)
        keywords = {}
        while isinstance(fn, functools.partial):
            keywords = {**fn.keywords, **keywords}
            fn = fn.func
        if keywords.get("use_reentrant", None) is not False:
            found.append(name or type(module).__name__)
    return found


def _keep(x):
    return x


def own_saved_tensors():
    """Context for the engine's own autograd work (the fallback's per-example re-runs, rule checks) while a region
    is checkpointed or recomputed: the tensors it saves bypass the checkpoint's hooks, which would count them as the
    region's."""
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)
