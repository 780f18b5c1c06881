"""Book-keeping one call of a hooked module: its use, its inputs (detached references), a hook on its outputs.

Outputs the engine needs a gradient for get one: a broadcast ``[1, ...]`` output is expanded to the batch, and an
output without a graph (ghost differentiation switched its parameters off and its inputs need no gradient) gets
``+ 0`` from a zero scalar that requires grad. Inside a region of activation checkpointing (:mod:`.checkpointing`)
the use is recorded in the forward pass without its inputs, which are book-kept when the backward pass recomputes
the region; the recomputed outputs get the same treatment (so the recomputation saves the same tensors) and no hook.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layers import Captured, Layout, UnsupportedModuleError
from ..layers.base import autocast_state
from .checkpointing import CHECKPOINTING_SUPPORTED, checkpoint_region, in_backward
from .coverage import HookedModule
from .planner import CallLayout
from .probe import flatten_call, flatten_output
from .rows import grad_layout
from .state import Use

__all__ = ["CallCapture", "Region"]


@dataclass(eq=False)
class Region:
    """The hooked calls of one checkpointed region in its forward pass (``None`` for a call that made no use), and
    where its recomputation is. ``outer_random``: a module covered by the fallback around the region was recording
    random draws when the region started (its recomputation would draw them another way)."""

    frame: Any
    records: list[tuple[HookedModule, Use | None]] = field(default_factory=list)
    cursor: int = 0
    outer_random: bool = False


class CallCapture:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: the forward hook of every hooked module."""

    def _on_forward(self, entry: HookedModule, module: nn.Module, args: tuple, kwargs: dict, output):
        plan, p = self._plan, self._pass
        if self._internal or p is None or plan is None:
            return None
        region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
        if not self._capturing:
            if region is not None and region[0] == "recompute" and p.phase is not None:
                return self._on_recompute(entry, module, args, kwargs, output, region[1])
            return None
        frame = self._forward_region(entry, region)
        random = self._pop_random_frame() if entry.is_fallback and self._record_random else []
        if frame is not None:
            random = []  # recorded again in the recomputation, which draws the same numbers
        shadowing = plan.shadowing.get(id(entry), ())
        params = entry.params
        shadowed = plan.shadowed.get(id(entry))
        if shadowed:
            skip = {q for q in shadowed if self._shadow_depth[q] - (q in shadowing) > 0}
            if skip:
                params = [q for q in params if q not in skip]
        for q in shadowing:
            self._shadow_depth[q] -= 1
        if not params or p.size == 0 or output is None:
            if frame is not None:
                self._region(frame).records.append((entry, None))
            return None
        if not torch.is_grad_enabled():
            raise UnsupportedModuleError(
                f"Module `{entry.name}` ({type(module).__name__}) ran without gradients inside the model's forward "
                "pass: reentrant activation checkpointing (`use_reentrant=True`, which backpropagates a second graph "
                "built in the backward pass) or a `torch.no_grad()` block around trainable parameters. Use "
                "non-reentrant checkpointing: `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                '{"use_reentrant": False})` (the transformers default) or `torch.utils.checkpoint.checkpoint(..., '
                "use_reentrant=False)`; or freeze the parameters used without gradients."
            )
        ordinal = p.ordinal.get(id(module), 0)
        out_leaves = flatten_output(output)
        in_leaves = flatten_call(args, kwargs) if entry.is_fallback else None
        layout = self._layout_for(entry, module, ordinal, in_leaves, out_leaves)
        if entry.is_fallback:
            use, new_output = self._capture_fallback(entry, params, module, args, kwargs, output, layout, random, frame)
        else:
            use, new_output = self._capture_closed_form(entry, params, module, args, kwargs, output, layout, frame)
        if frame is not None:
            self._region(frame).records.append((entry, use))
        return new_output

    def _forward_region(self, entry: HookedModule, region) -> Any:
        """The checkpoint frame of a call in the forward pass (``None`` outside checkpointing), or raise."""
        if region is None:
            return None
        kind, frame = region
        if kind != "forward" or in_backward():
            raise UnsupportedModuleError(
                f"Module `{entry.name}` runs in a checkpointed region nested in the recomputation of another: nested "
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

    def _region_start(self) -> None:
        """A hooked module starts in the forward pass: note the checkpointed region it is in (first call first)."""
        region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
        if region is not None and region[0] == "forward":
            self._region(region[1])

    def _on_random_draw(self) -> None:
        """The recorder replaced or kept a random draw: refuse one it could not replay in a recomputation."""
        region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
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

    # ------------------------------------------------------------------ outputs and inputs
    def _closed_form_output(self, output: Tensor, layout: CallLayout) -> tuple[Tensor, Tensor | None]:
        """The output to hook, and the output to return instead of the module's (``None``: keep it)."""
        out_layout: Layout = layout.outputs[0]
        new_output = None
        if out_layout.broadcast:
            output = new_output = output.expand(self._pass.size * out_layout.repeat, *output.shape[1:])
        if not output.requires_grad:
            # Ghost differentiation leaves this output without a graph (its inputs need no gradient and its
            # parameters are switched off); a zero scalar that requires grad gives it one at ~no cost.
            output = new_output = output + self._origin(output)
        return output, new_output

    def _fallback_outputs(self, output, layout: CallLayout) -> tuple[list[int], list[Tensor], Any]:
        """Positions and tensors to hook among the flattened outputs, and the output to return (``None``: keep)."""
        b = self._pass.size
        leaves, spec = tree_flatten(output)
        positions, tensors, changed = [], [], False
        for j, (leaf, lay) in enumerate(zip(leaves, layout.outputs, strict=True)):
            if lay is None:
                continue
            if lay.broadcast:
                leaf, changed = leaf.expand(b * lay.repeat, *leaf.shape[1:]), True
            if not leaf.requires_grad:
                leaf, changed = leaf + self._origin(leaf), True
            leaves[j] = leaf
            positions.append(j)
            tensors.append(leaf)
        return positions, tensors, tree_unflatten(leaves, spec) if changed else None

    def _closed_form_inputs(self, entry: HookedModule, module, args, kwargs, output) -> Captured:
        captured = entry.rule.capture(module, args, kwargs, output)
        captured.args = tuple(x.detach() if isinstance(x, Tensor) else x for x in captured.args)
        return captured

    def _fallback_inputs(self, args, kwargs, layout: CallLayout, random: list) -> Captured:
        in_leaves, in_spec = tree_flatten((tuple(args), dict(kwargs)))
        out_layouts = [None if lay is None else grad_layout(lay) for lay in layout.outputs]
        in_leaves = [None if i in layout.drop else x for i, x in enumerate(in_leaves)]  # caches: proven empty here
        detached = tree_unflatten([x.detach() if isinstance(x, Tensor) else x for x in in_leaves], in_spec)
        return Captured(
            args=detached[0],
            kwargs=detached[1],
            layouts=(layout.inputs, out_layouts),
            batch_size=self._pass.size,
            autocast=autocast_state(),
            random=random,
        )

    def _capture_closed_form(self, entry, params, module, args, kwargs, output, layout: CallLayout, frame):
        if not isinstance(output, Tensor):
            raise UnsupportedModuleError(
                f"Module `{entry.name}` ({type(module).__name__}) returned {type(output).__name__} instead of the "
                "tensor it returned on the first batch."
            )
        captured = None if frame is not None else self._closed_form_inputs(entry, module, args, kwargs, output)
        hooked, new_output = self._closed_form_output(output, layout)
        use = Use(entry, params, captured, layout, region=frame)
        self._pass.uses.append(use)
        hooked.register_hook(functools.partial(self._on_output_grad, use, None))
        return use, new_output

    def _capture_fallback(self, entry, params, module, args, kwargs, output, layout: CallLayout, random, frame):
        positions, tensors, new_output = self._fallback_outputs(output, layout)
        captured = None if frame is not None else self._fallback_inputs(args, kwargs, layout, random)
        use = Use(entry, params, captured, layout, region=frame)
        self._pass.uses.append(use)
        if len(tensors) == 1:
            tensors[0].register_hook(functools.partial(self._on_output_grad, use, positions))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._on_output_grads, use, positions), mode="all"
            )
        return use, new_output

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
            self._push_random_frame()

    def _recompute_leave(self) -> None:
        """Parameters back in autograd after the backward pass (``finish()``), or when a pass was abandoned."""
        if self._recomputing:
            self._recomputing = False
            self._set_trainable_requires_grad(True)

    def _on_recompute(self, entry: HookedModule, module, args, kwargs, output, frame):
        p = self._pass
        region = p.regions.get(id(frame))
        if region is None or region.frame is not frame or not region.records:
            raise UnsupportedModuleError(
                f"Module `{entry.name}` is recomputed in a checkpointed region that hf_dp did not see in the forward "
                "pass (a region entered outside the model's forward, or nested checkpointing)."
            )
        if region.cursor >= len(region.records):
            region.cursor = 0  # a new recomputation of the region (another backward pass)
        recorded, use = region.records[region.cursor]
        region.cursor += 1
        random = self._pop_random_frame() if entry.is_fallback and p.record_random else []
        if recorded is not entry:
            raise UnsupportedModuleError(
                f"The recomputation of a checkpointed region called `{entry.name}` where its forward pass called "
                f"`{recorded.name}`: the region is not deterministic, so its book-kept inputs would not be those of "
                "the forward pass."
            )
        if use is None:
            return None
        new_output = None
        if output is None:
            pass  # checkpoint's early stop ended the recomputation inside this call: its inputs are all there is
        elif entry.is_fallback:
            _, _, new_output = self._fallback_outputs(output, use.layout)
        else:
            _, new_output = self._closed_form_output(output, use.layout)
        if p.phase == "record" and not use.processed:
            if entry.is_fallback:
                use.captured = self._fallback_inputs(args, kwargs, use.layout, random)
            else:
                use.captured = self._closed_form_inputs(entry, module, args, kwargs, output)
            if use.pending_grad is not None:  # the output gradient arrived before the recomputation
                grad, use.pending_grad = use.pending_grad, None
                self._on_grad(use, grad)
        return new_output
