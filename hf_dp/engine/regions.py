"""Checkpointed regions in the forward pass and their recomputation in the backward pass (:mod:`.checkpointing`).

Inside a region of activation checkpointing a hooked call's use is recorded in the forward pass without its inputs
(:mod:`.capture`), and book-kept when the backward pass recomputes the region: the recomputation must call the same
hooked modules in the same order. While it runs, the trainable parameters stay out of autograd (so that it saves
the same tensors as the forward pass did). A reentrant region (``use_reentrant=True``) runs its forward without
gradients and recomputes itself in a nested backward pass, entered and left through hooks on its autograd node.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import UnsupportedModuleError
from .checkpointing import (
    CHECKPOINTING_SUPPORTED,
    REENTRANT_SUPPORTED,
    captures_grad,
    checkpoint_region,
    graph_task_id,
    in_backward,
    reentrant_forward,
)
from .coverage import HookedModule
from .state import Use

__all__ = ["CheckpointRegions", "Region"]


@dataclass(eq=False)
class Region:
    """The hooked calls of one checkpointed region in its forward pass (``None`` for a call that made no use), and
    where its recomputation is. ``outer_random``: a module covered by the fallback around the region was recording
    random draws when the region started (its recomputation would draw them another way). A reentrant region's
    ``frame`` is its autograd node; ``outer_task`` is the graph task of the backward pass that recomputes it."""

    frame: Any
    records: list[tuple[HookedModule, Use | None]] = field(default_factory=list)
    cursor: int = 0
    outer_random: bool = False
    reentrant: bool = False
    outer_task: int | None = None


class CheckpointRegions:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: the checkpointed regions of a forward pass, and their
    recomputation."""

    # ------------------------------------------------------------------ forward pass
    def _forward_region(self, name: str, region) -> Any:
        """The checkpoint frame of a call in the forward pass (``None`` outside checkpointing), or raise."""
        if region is None:
            return None
        kind, frame = region
        if kind == "recompute" or in_backward():
            raise UnsupportedModuleError(
                f"Module `{name}` runs in a checkpointed region nested in the recomputation of another: nested "
                "activation checkpointing is not supported. Checkpoint each layer once."
            )
        if self.mode == "ghost":
            raise UnsupportedModuleError(
                "Activation checkpointing is not supported in `ghost` mode (its second backward pass would recompute "
                "the regions without book-keeping). Use `mode='bk-mixopt'` (or `bk`, `per-sample`), or turn "
                "checkpointing off."
            )
        return frame

    def _region(self, frame) -> Region:
        regions = self._pass.regions
        region = regions.get(id(frame))
        if region is None or region.frame is not frame:
            outer = self._recorder is not None and bool(self._recorder.frames)
            region = regions[id(frame)] = Region(frame, outer_random=outer)
        return region

    def _region_start(self, module: nn.Module) -> None:
        """A hooked module starts in the forward pass: note the checkpointed region it is in (first call first)."""
        region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
        if not torch.is_grad_enabled():
            region = self._reentrant_region(module, region)
        if region is not None and region[0] == "forward":
            self._region(region[1])

    def _reentrant_region(self, module: nn.Module | str, region) -> tuple[str, Any] | None:
        """``("reentrant", node)`` for a call of ``module`` (or its name) without gradients inside the forward of a
        reentrant checkpoint region (``region`` as it is otherwise); the first call of a region checks the region
        and hooks its node."""
        call = reentrant_forward() if REENTRANT_SUPPORTED else None
        if call is None:
            return region
        known = self._pass.regions.get(id(call.node))
        if known is not None and known.frame is call.node:
            return ("reentrant", call.node)
        name = module if isinstance(module, str) else self._names()[0].get(id(module), type(module).__name__)
        if region is not None or in_backward() or reentrant_forward(full=True).enclosed:
            raise UnsupportedModuleError(
                f"Module `{name}` runs in a region of reentrant activation checkpointing nested in another "
                "checkpointed region: nested activation checkpointing is not supported. Checkpoint each layer once."
            )
        self._forward_region(name, ("reentrant", call.node))  # ghost mode refuses here
        if not any(isinstance(x, Tensor) and x.requires_grad for x in call.inputs):
            raise UnsupportedModuleError(
                f"Module `{name}` runs in a region of reentrant activation checkpointing (`use_reentrant=True`) none "
                "of whose tensor inputs requires grad: torch backpropagates nothing through such a region, so its "
                "trainable parameters would get no gradient (e.g. frozen input embeddings before trainable layers). "
                "Call `model.enable_input_require_grads()` before training, or use non-reentrant checkpointing: "
                '`gradient_checkpointing_kwargs={"use_reentrant": False}` (the transformers default).'
            )
        if captures_grad(call.function):
            raise UnsupportedModuleError(
                f"Module `{name}` runs in a region of reentrant activation checkpointing (`use_reentrant=True`) whose "
                "function holds a tensor that requires grad other than as a positional input (a keyword argument, "
                "e.g. `encoder_hidden_states`, or a closure): the region's second backward pass would backpropagate "
                "into the rest of the graph, so book-keeping would see part of an output gradient. Pass such tensors "
                'positionally, or use non-reentrant checkpointing: `gradient_checkpointing_kwargs={"use_reentrant": '
                "False}` (the transformers default)."
            )
        region = self._region(call.node)
        region.reentrant = True
        ref = weakref.ref(region)
        call.node.register_prehook(functools.partial(self._reentrant_enter, ref))
        call.node.register_hook(functools.partial(self._reentrant_leave, ref))
        return ("reentrant", call.node)

    def _on_random_draw(self) -> None:
        """The recorder replaced or kept a random draw: refuse one it could not replay in a recomputation."""
        region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
        call = getattr(self._recorder, "reentrant", None)  # recorded in the forward of a reentrant region
        if region is None and call is not None and self._capturing:
            region = ("forward", call.node)
        if region is None or region[0] != "forward" or self._pass is None:
            return
        known = self._pass.regions.get(id(region[1]))
        if known is None or known.outer_random:
            raise UnsupportedModuleError(
                "A random draw (dropout, stochastic depth) runs in a checkpointed region inside a module covered by "
                "the torch.func fallback whose hooks are outside the region (e.g. BEiT's layer scales, covered on "
                "each checkpointed layer): its per-example replay and the recomputation of the region would draw "
                "differently. Set the dropout and drop-path probabilities to 0, freeze the fallback's parameters, or "
                "turn activation checkpointing off."
            )

    # ------------------------------------------------------------------ recomputation
    def _recompute_enter(self, module: nn.Module) -> None:
        """A hooked module starts in a recomputation: parameters out of autograd (as in the forward pass, so that
        the recomputation saves the same tensors), random draws of fallback modules recorded (as in the forward).

        The parameters stay out of autograd until ``finish()``: a trainable parameter can be used anywhere in the
        region (a fallback module around it reads its own), and the end of a recomputation cannot be observed.
        Autograd then skips the gradient of a use outside the model's forward pass, so ``prepare()`` looks for such
        uses in the loss's graph instead (:meth:`_check_graph_for_bypass`)."""
        p = self._pass
        if p.ghost_diff and not self._recomputing:
            self._recomputing = True
            self._set_trainable_requires_grad(False)
        if p.record_random and id(module) in self._fallback_modules:
            self._push_random_frame(self._fallback_modules[id(module)])

    def _recompute_leave(self) -> None:
        """Parameters back in autograd after the backward pass (``finish()``), or when a pass was abandoned."""
        if self._pass is not None:
            self._pass.recomputing.clear()
        if self._recomputing:
            self._recomputing = False
            self._set_trainable_requires_grad(True)

    def _reentrant_top(self) -> Region | None:
        """The reentrant region this thread is recomputing (autograd runs the nodes of each device on its own
        thread), innermost last."""
        stack = self._pass.recomputing.get(threading.get_ident()) if self._pass is not None else None
        return stack[-1] if stack else None

    def _reentrant_enter(self, ref: weakref.ref, grad_outputs):
        """Pre-hook of a reentrant region's node, just before it recomputes the region: parameters out of autograd
        (so that its nested backward pass writes no ``p.grad``, even for a graph no ``prepare()`` covers), and the
        region on top of the regions being recomputed."""
        if self._root_handles and not self._internal and not self._recomputing:
            self._recomputing = True  # until finish() or the next forward pass
            self._set_trainable_requires_grad(False)
        region, p = ref(), self._pass
        if region is None or p is None or p.phase is None or p.regions.get(id(region.frame)) is not region:
            return None
        task = graph_task_id()
        if any(stack[0].outer_task != task for stack in p.recomputing.values() if stack):
            raise UnsupportedModuleError(
                "A region of reentrant activation checkpointing is recomputed inside the second backward pass of "
                "another (nested checkpointing, or a tensor of one region captured by another): not supported. "
                "Checkpoint each layer once, or use non-reentrant checkpointing."
            )
        region.cursor, region.outer_task = 0, task
        p.recomputing.setdefault(threading.get_ident(), []).append(region)
        return None

    def _reentrant_leave(self, ref: weakref.ref, grad_inputs, grad_outputs):
        """Hook of a reentrant region's node, after its nested backward pass: every hooked call recorded in the
        forward must have been recomputed (a call missing there would get no output hook: a silent zero)."""
        region, p = ref(), self._pass
        stack = [] if p is None else p.recomputing.get(threading.get_ident(), [])
        if region is None or not any(r is region for r in stack):
            return None
        stack[:] = [r for r in stack if r is not region]
        if not stack:
            del p.recomputing[threading.get_ident()]
        if region.cursor != len(region.records):
            missing = [entry.name for entry, _ in region.records[region.cursor :]]
            raise UnsupportedModuleError(
                f"The recomputation of a reentrant checkpointed region did not call {missing[:3]}, which its forward "
                "pass called: the region is not deterministic, and their per-example gradients would be missing."
            )
        return None

    def _check_reentrant_task(self, use: Use) -> None:
        """While a reentrant region is recomputed, the output hook of a call outside it must fire in the backward
        pass that recomputes the region, not in the region's nested one (which reached the rest of the graph through
        a tensor the region captured, and carries part of the output gradient only)."""
        p = self._pass
        outer = next((stack[0].outer_task for stack in p.recomputing.values() if stack), None)
        if use.reentrant or outer is None or graph_task_id() == outer:
            return
        raise UnsupportedModuleError(
            f"The output gradient of `{use.entry.name}` reached it through the second backward pass of a region of "
            "reentrant activation checkpointing: the region's function holds a tensor that requires grad other than "
            "as a positional input (a keyword argument or a closure), and book-keeping would see part of that "
            "gradient only. Pass such tensors positionally, or use non-reentrant checkpointing: "
            '`gradient_checkpointing_kwargs={"use_reentrant": False}` (the transformers default).'
        )
