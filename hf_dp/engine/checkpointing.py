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

Which non-reentrant region a call belongs to is read from the saved-tensor hooks on top of autograd's stack (those of
``torch.utils.checkpoint``'s ``_checkpoint_hook`` and ``_recomputation_hook``): :func:`checkpoint_region`.

Reentrant checkpointing (``use_reentrant=True``: ``torch.utils.checkpoint.CheckpointFunction``) runs the region's
forward without gradients; in the backward pass, the region's autograd node re-runs it with gradients and
backpropagates that new graph (a nested backward pass), which is where the gradients of the region's outputs reach
its hooked calls. Book-keeping follows it:

* in the forward a hooked call runs without gradients inside ``CheckpointFunction.forward``, found on the Python
  stack (:func:`reentrant_forward`; its ``ctx`` is the region's autograd node, the same object in the backward pass):
  it records its use (layout, parameters) and keeps no input; its output has no graph, so it gets no hook yet. The
  first call of a region puts a pre-hook and a hook on the node. Random draws of fallback modules are recorded there
  as with gradients, so that the region draws as its recomputation will.
* the node's pre-hook runs just before the recomputation: parameters out of autograd (so that the nested backward
  pass writes no ``p.grad``; they stay out until ``finish()`` or the next forward pass), and the region on top of the
  regions this thread is recomputing (autograd runs each device's nodes on a thread of its own). Each hooked call of
  the recomputation is matched to the k-th of the forward, its inputs are book-kept, and its recomputed output gets
  the output hook, which the nested backward pass calls. The node's hook checks that every recorded call was
  recomputed (a missing one would be a silent zero).

What reentrant checkpointing cannot make exact is refused: a region none of whose tensor inputs requires grad (torch
leaves its parameters without a gradient; transformers' ``enable_input_require_grads()`` gives frozen input
embeddings one), a region whose function holds a tensor that requires grad other than as a positional input (a
keyword argument bound by ``functools.partial``, or a closure: the nested backward pass would run part of the outer
graph, and an output hook reached there, in another graph task than the backward pass recomputing the region, would
see part of its gradient), nested regions, and the whole model inside a region. The torch.func fallback's per-example
re-run of a module runs it without transformers' reentrant checkpointing (:func:`rerun_without_reentrant`); another
reentrant region there (on inputs that need no gradient) is refused. The engine's own backward passes (the
first-batch support check, the self-check's norms) cannot use ``torch.autograd.grad`` or ``inputs=`` through a
reentrant region: they run a plain backward pass that restores every leaf's ``.grad`` (:func:`backward_keeping_grads`).

If this torch does not expose what the engine relies on, :data:`CHECKPOINTING_SUPPORTED` (both modes) or
:data:`REENTRANT_SUPPORTED` is false and the checkpointing concerned is refused.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..layers import UnsupportedModuleError

__all__ = [
    "CHECKPOINTING_SUPPORTED",
    "REENTRANT_SUPPORTED",
    "ReentrantForward",
    "backward_keeping_grads",
    "captures_grad",
    "checkpoint_region",
    "graph_leaves",
    "graph_task_id",
    "in_backward",
    "own_saved_tensors",
    "reentrant_checkpointing",
    "reentrant_forward",
    "rerun_without_reentrant",
]

_top_hooks = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)

#: Whether this torch lets the engine tell a checkpointed forward and a recomputation apart.
CHECKPOINTING_SUPPORTED: bool = _top_hooks is not None and _graph_task_id is not None

_checkpoint_function = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
_reentrant_forward_code = getattr(getattr(_checkpoint_function, "forward", None), "__code__", None)
_node_hooks = all(hasattr(torch.autograd.graph.Node, name) for name in ("register_prehook", "register_hook"))

#: Whether this torch lets the engine follow reentrant checkpointing (``CheckpointFunction``'s forward on the stack,
#: hooks on its node, the graph task of a backward pass).
REENTRANT_SUPPORTED: bool = CHECKPOINTING_SUPPORTED and _reentrant_forward_code is not None and _node_hooks


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


def graph_task_id() -> int:
    """The id of the graph task autograd is running on this thread (-1 outside a backward pass)."""
    return -1 if _graph_task_id is None else _graph_task_id()


@dataclass
class ReentrantForward:
    """The forward of a reentrant checkpoint region in progress (a ``CheckpointFunction.forward`` frame)."""

    node: Any  #: the region's autograd node (``ctx``), the same object in the backward pass
    inputs: tuple  #: what the region's function is called with
    function: Any  #: the region's function
    enclosed: bool = False  #: inside the forward of another reentrant region (only looked for with ``full``)


def reentrant_forward(*, full: bool = False) -> ReentrantForward | None:
    """The innermost reentrant checkpoint region whose forward is on this thread's stack, or ``None`` (and with
    ``full``, whether another one encloses it)."""
    if _reentrant_forward_code is None:
        return None
    frame, found = sys._getframe(1), None
    while frame is not None:
        if frame.f_code is _reentrant_forward_code:
            if found is not None:
                found.enclosed = True
                return found
            local = frame.f_locals
            node = local.get("ctx")
            if not hasattr(node, "register_prehook") or "args" not in local or "run_function" not in local:
                return None  # not the forward this module knows
            found = ReentrantForward(node, tuple(local["args"]), local["run_function"])
            if not full:
                return found
        frame = frame.f_back
    return found


def captures_grad(function: Any) -> bool:
    """Whether ``function`` holds a tensor that requires grad in the arguments ``functools.partial`` bound to it or
    in its closure: a reentrant region would backpropagate it in its nested backward pass."""
    held = []
    while isinstance(function, functools.partial):
        held.extend(function.args)
        held.extend(function.keywords.values())
        function = function.func
    function = getattr(function, "__func__", function)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    leaves, _ = tree_flatten(held)
    return any(isinstance(x, Tensor) and x.requires_grad for x in leaves)


def graph_leaves(tensor: Tensor) -> Iterator[Tensor]:
    """The leaf tensors autograd would accumulate into in a backward pass of ``tensor`` (its graph's
    ``AccumulateGrad`` nodes), each once."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, Tensor):
            yield var
        stack.extend(n for n, _ in node.next_functions)


def backward_keeping_grads(tensor: Tensor, *, retain_graph: bool = False) -> None:
    """``tensor.backward()`` that leaves the ``.grad`` of every leaf of the graph as it was: for the engine's own
    backward passes through reentrant checkpointing, which refuses ``torch.autograd.grad`` and ``inputs=``. (Leaves
    of the graphs recomputed in it are the engine's own or out of autograd.)"""
    leaves = {id(var): (var, var.grad) for var in graph_leaves(tensor)}
    for var, _ in leaves.values():
        var.grad = None  # autograd would accumulate into the kept tensor in place
    try:
        torch.autograd.backward(tensor, retain_graph=retain_graph)
    finally:
        for var, grad in leaves.values():
            var.grad = grad


def _reentrant(module: nn.Module) -> bool:
    if getattr(module, "gradient_checkpointing", False) is not True:
        return False
    fn = getattr(module, "_gradient_checkpointing_func", None)
    keywords = {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    return keywords.get("use_reentrant", None) is not False


def reentrant_checkpointing(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` (transformers' ``gradient_checkpointing`` flag on) whose checkpoint function
    is reentrant: ``torch.utils.checkpoint.checkpoint`` without ``use_reentrant=False`` (its default is reentrant)."""
    return [name or type(module).__name__ for name, module in model.named_modules() if _reentrant(module)]


_NO_INPUT_GRAD = "None of the inputs have requires_grad=True"


@contextlib.contextmanager
def rerun_without_reentrant(module: nn.Module, name: str) -> Iterator[None]:
    """Around the torch.func fallback's per-example re-run of ``module`` (``name``: for messages), which runs on
    inputs that need no gradient: a reentrant region there would pass no gradient to the parameters it uses (a
    silent zero), so transformers' reentrant checkpointing is switched off inside ``module`` for the re-run (the same
    math), and any other reentrant region whose inputs need no gradient raises."""
    switched = [m for m in module.modules() if _reentrant(m)]
    for m in switched:
        m.gradient_checkpointing = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=_NO_INPUT_GRAD, category=UserWarning)
            yield
    except UserWarning as err:
        if _NO_INPUT_GRAD not in str(err):
            raise
        raise UnsupportedModuleError(
            f"`{name}` is covered by the torch.func fallback and runs reentrant activation checkpointing "
            "(`torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`) in its forward: its per-example re-run "
            "would pass no gradient through the region to the parameters used there. Use `use_reentrant=False`, or "
            "checkpoint outside this module."
        ) from err
    finally:
        for m in switched:
            m.gradient_checkpointing = True


def _keep(x):
    return x


def own_saved_tensors():
    """Context for the engine's own autograd work (the fallback's per-example re-runs, rule checks) while a region
    is checkpointed or recomputed: the tensors it saves bypass the checkpoint's hooks, which would count them as the
    region's."""
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)
