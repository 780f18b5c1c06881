"""Book-keeping one call of a hooked module: its use, its inputs (detached references), a hook on its outputs.

Outputs the engine needs a gradient for get one: a broadcast ``[1, ...]`` output is expanded to the batch, and an
output without a graph (ghost differentiation switched its parameters off and its inputs need no gradient) gets
``+ 0`` from a zero scalar that requires grad. Inside a region of activation checkpointing (:mod:`.checkpointing`,
followed by :mod:`.regions`) the use is recorded in the forward pass without its inputs, which are book-kept when the
backward pass recomputes the region; the recomputed outputs get the same treatment (so the recomputation saves the
same tensors), and the output hook if the region is reentrant (its forward ran without gradients: the hook goes on
the recomputed output, whose gradient the region's nested backward pass computes).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layers import Captured, Layout, UnsupportedModuleError
from ..layers.base import autocast_state
from .checkpointing import CHECKPOINTING_SUPPORTED, checkpoint_region
from .coverage import HookedModule
from .planner import CallLayout
from .probe import flatten_call, flatten_output
from .rows import grad_layout
from .state import Use

__all__ = ["CallCapture", "storage_root"]


def _top_mode():
    """The innermost torch function mode in effect on this thread (``None`` without one)."""
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n > 0 else None


def _records_random(entry: HookedModule) -> bool:
    """Whether the random draws of ``entry``'s calls are recorded (a frame was pushed at its start)."""
    return entry.is_fallback or entry.rule.records_random


def storage_root(t: Tensor) -> tuple[Tensor, torch.Size | None]:
    """The tensor whose hook sees ``t``'s gradient even after an in-place write on ``t`` or on a view of it, and the
    shape to view that gradient as (``None``: ``t`` itself). A hook on a view is dropped from the graph when the view
    is written in place (autograd rebases the view on its base), a hook on a base survives it (it receives the
    gradient of the value before the write). ``F.linear`` on a ``[B, T, d]`` input returns a view of its ``[B*T, p]``
    result: such a whole, contiguous view is hooked through its base; other views keep their own hook."""
    base = t._base
    if (
        base is None
        or not base.requires_grad
        or base.numel() != t.numel()
        or base.storage_offset() != t.storage_offset()
        or not (t.is_contiguous() and base.is_contiguous())
    ):
        return t, None
    return base, t.shape


class CallCapture:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: the forward hook of every hooked module."""

    def _on_forward(self, entry: HookedModule, module: nn.Module, args: tuple, kwargs: dict, output):
        plan, p = self._plan, self._pass
        if self._internal or p is None or plan is None:
            return None
        region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
        if not self._capturing:
            if p.phase is None:
                return None
            if region is not None and region[0] == "recompute":
                return self._on_recompute(entry, module, args, kwargs, output, region[1])
            top = self._reentrant_top()
            if top is not None and torch.is_grad_enabled():  # the recomputation of that reentrant region
                return self._on_recompute(entry, module, args, kwargs, output, top.frame)
            return None
        grad_enabled = torch.is_grad_enabled()
        if not grad_enabled:
            region = self._reentrant_region(entry.name, region)
        frame = self._forward_region(entry.name, region)
        reentrant = region is not None and region[0] == "reentrant"
        random = self._pop_random_frame() if _records_random(entry) and self._record_random else []
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
        if not grad_enabled and not reentrant:
            # A call under `torch.no_grad()` (DeepSeek-V3.2's indexer): plain autograd gives its parameters no gradient
            # from it, and neither do we. A checkpoint function hf_dp does not know would recompute the call with
            # gradients in the backward pass, where autograd writes `p.grad` itself: `finish()` refuses that.
            if frame is not None:
                self._region(frame).records.append((entry, None))
            return None
        # On the verified forward pass the use recorder sees every torch function called; the book-keeping below is
        # the engine's own and uses no trainable parameter (it reads the call's inputs and outputs), so it runs with
        # the recorder set aside (taken off the mode stack when it is on top, i.e. no mode of the model's is inside
        # it, and put back after), instead of passing each of its torch calls through it.
        mode = self._verification.mode if self._verification is not None else None
        if mode is None or _top_mode() is not mode:
            return self._book_keep(entry, module, args, kwargs, output, params, frame, reentrant, random)
        torch._C._pop_torch_function_stack()
        try:
            return self._book_keep(entry, module, args, kwargs, output, params, frame, reentrant, random)
        finally:
            torch._C._push_on_torch_function_stack(mode)

    def _book_keep(self, entry: HookedModule, module, args, kwargs, output, params, frame, reentrant, random):
        """Book-keep one call of a hooked module in the forward pass (its layout, its inputs, its output hook)."""
        p = self._pass
        ordinal = p.ordinal.get(id(module), 0)
        out_leaves = flatten_output(output)
        in_leaves = flatten_call(args, kwargs) if entry.is_fallback else None
        with self._copies_paused:  # the engine's own work (a new path's proof, expansions) makes no copies
            layout = self._deferral(
                entry, self._layout_for(entry, module, ordinal, in_leaves, out_leaves), out_leaves, frame, reentrant
            )
            return self._book_keep_call(entry, module, args, kwargs, output, params, frame, reentrant, random, layout)

    def _book_keep_call(self, entry, module, args, kwargs, output, params, frame, reentrant, random, layout):
        p = self._pass
        if reentrant:
            use = Use(entry, params, None, layout, region=frame, reentrant=True)
            p.uses.append(use)
            new_output = self._broadcast_outputs(output, layout, entry.is_fallback)
        elif entry.is_fallback:
            use, new_output = self._capture_fallback(entry, params, module, args, kwargs, output, layout, random, frame)
        else:
            use, new_output = self._capture_closed_form(entry, params, module, args, kwargs, output, layout, frame)
            if use.captured is not None:
                use.captured.random = random
        if frame is not None:
            self._region(frame).records.append((entry, use))
        return new_output

    # ------------------------------------------------------------------ outputs and inputs
    def _closed_form_output(self, output: Tensor, layout: CallLayout) -> tuple[Tensor, Tensor | None]:
        """The output to hook, and the output to return instead of the module's (``None``: keep it)."""
        out_layout: Layout = layout.outputs[0]
        new_output = None
        if layout.deferred:
            output = new_output = self._shared_tensor(output)
            return output, new_output
        if out_layout.broadcast:
            output = new_output = output.expand(self._pass.size * out_layout.repeat, *output.shape[1:])
        if not output.requires_grad:
            # Ghost differentiation leaves this output without a graph (its inputs need no gradient and its
            # parameters are switched off); a zero scalar that requires grad gives it one at ~no cost.
            output = new_output = output + self._origin(output)
        return output, new_output

    def _broadcast_outputs(self, output, layout: CallLayout, fallback: bool) -> Any:
        """The output to return instead of the module's in the forward of a reentrant region (``None``: keep it):
        broadcast ``[1, ...]`` outputs expanded as the recomputation will (no graph to give them here)."""
        if not fallback:
            lay = layout.outputs[0]
            return output.expand(self._pass.size * lay.repeat, *output.shape[1:]) if lay.broadcast else None
        leaves, spec = tree_flatten(output)
        changed = False
        for j, lay in enumerate(layout.outputs):
            if lay is not None and lay.broadcast:
                leaves[j], changed = leaves[j].expand(self._pass.size * lay.repeat, *leaves[j].shape[1:]), True
        return tree_unflatten(leaves, spec) if changed else None

    def _hook_outputs(self, use: Use, positions: list[int] | None, tensors: list[Tensor]) -> None:
        """The output hook of ``use`` on its hooked output tensors (``positions``: among the flattened outputs of a
        fallback call; ``None`` for the one output of a closed-form call).

        A closed-form output is hooked on its storage root, whose hook survives the caller's in-place writes (a
        standard layer does not use its own output). A hook that an in-place write could drop (on a view that is not
        a whole view of its base) is noted with the tensor's version, checked before the backward pass. Deferred
        outputs: :meth:`~.shared_outputs.SharedOutputs._hook_shared`."""
        if use.layout.deferred:
            self._hook_shared(use, positions, tensors)
            return
        if positions is None:
            target, shape = storage_root(tensors[0])
            if shape is not None:
                target.register_hook(functools.partial(self._on_root_grad, use, shape))
                return
            if target._base is not None:
                use.versions.append((target, target._version))
            target.register_hook(functools.partial(self._on_output_grad, use, None))
            return
        use.versions.extend((t, t._version) for t in tensors if t._base is not None)  # an expansion
        if len(tensors) == 1:
            tensors[0].register_hook(functools.partial(self._on_output_grad, use, positions))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._on_output_grads, use, positions), mode="all"
            )

    def _fallback_outputs(self, output, layout: CallLayout) -> tuple[list[int], list[Tensor], Any]:
        """Positions and tensors to hook among the flattened outputs, and the output to return instead of the module's.

        A module may use a tensor it returns (an MoE router routes with the logits it returns; eager attention
        returns the weights it applies): that tensor's gradient then includes the internal use, which the fallback's
        re-run differentiates again. So each hooked output is returned as a tensor of its own whose gradient is the
        caller's alone (DESIGN §18): a copy (a fallback's re-run per example costs far more than copying its output),
        the ``+ origin`` sum of an output without a graph, or the expansion of a broadcast output (a view that torch
        refuses to write in place). A copy's hook survives the caller's in-place writes (Falcon adds its attention
        output into the MLP's in place); a view's would not."""
        b = self._pass.size
        leaves, spec = tree_flatten(output)
        positions, tensors = [], []
        for j, (leaf, lay) in enumerate(zip(leaves, layout.outputs, strict=True)):
            if lay is None:
                continue
            if lay.broadcast and layout.deferred:
                leaf = self._shared_tensor(leaf)
            elif lay.broadcast:
                leaf = leaf.expand(b * lay.repeat, *leaf.shape[1:])
            if not leaf.requires_grad:
                leaf = leaf + self._origin(leaf)
            elif not lay.broadcast:
                leaf = leaf.clone()
            leaves[j] = leaf
            positions.append(j)
            tensors.append(leaf)
        return positions, tensors, tree_unflatten(leaves, spec) if positions else None

    def _closed_form_inputs(self, entry: HookedModule, module, args, kwargs, output) -> Captured:
        # kept as they are (no `detach()`: one op per input per call): rules read them under `no_grad`, and the graph
        # they belong to lives until the backward pass that book-keeps them anyway
        return entry.rule.capture(module, args, kwargs, output)

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
            expanded=tuple(lay is not None and lay.broadcast for lay in layout.outputs),
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
        self._hook_outputs(use, None, [hooked])
        return use, new_output

    def _capture_fallback(self, entry, params, module, args, kwargs, output, layout: CallLayout, random, frame):
        positions, tensors, new_output = self._fallback_outputs(output, layout)
        captured = None if frame is not None else self._fallback_inputs(args, kwargs, layout, random)
        use = Use(entry, params, captured, layout, region=frame)
        self._pass.uses.append(use)
        self._hook_outputs(use, positions, tensors)
        return use, new_output

    # ------------------------------------------------------------------ recomputation
    def _on_recompute(self, entry: HookedModule, module, args, kwargs, output, frame):
        """Book-keep a hooked call in the recomputation of the checkpointed region ``frame``
        (:class:`~.regions.CheckpointRegions`): the call its forward pass recorded at this point, whose inputs are
        book-kept now (and its outputs hooked, in a reentrant region)."""
        p = self._pass
        region = p.regions.get(id(frame))
        if region is None or region.frame is not frame or not region.records:
            raise UnsupportedModuleError(
                f"Module `{entry.name}` is recomputed in a checkpointed region that hf_dp did not see in the forward "
                "pass (a region entered outside the model's forward, or nested checkpointing)."
            )
        if region.cursor >= len(region.records):
            if region.reentrant:  # its node's pre-hook starts each recomputation at 0
                raise UnsupportedModuleError(
                    f"The recomputation of a reentrant checkpointed region called `{entry.name}` after every hooked "
                    "call its forward pass made: the region is not deterministic."
                )
            region.cursor = 0  # a new recomputation of the region (another backward pass)
        recorded, use = region.records[region.cursor]
        region.cursor += 1
        random = self._pop_random_frame() if _records_random(entry) and p.record_random else []
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
            positions, tensors, new_output = self._fallback_outputs(output, use.layout)
            if region.reentrant:
                self._hook_outputs(use, positions, tensors)
        else:
            hooked, new_output = self._closed_form_output(output, use.layout)
            if region.reentrant:
                self._hook_outputs(use, None, [hooked])
        if p.phase == "record" and not use.processed:
            if entry.is_fallback:
                use.captured = self._fallback_inputs(args, kwargs, use.layout, random)
            else:
                use.captured = self._closed_form_inputs(entry, module, args, kwargs, output)
                use.captured.random = random
            if use.pending_grad is not None:  # the output gradient arrived before the recomputation
                grad, use.pending_grad = use.pending_grad, None
                self._on_grad(use, grad)
        return new_output
