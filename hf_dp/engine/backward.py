"""The backward side of ``BookKeepingClipper``: the start of the book-keeping of a backward pass (``prepare()``),
per-example gradients from each hooked call's output gradient, the first-batch check that loss ``j`` depends on
example ``j`` alone, and the checks that no gradient bypassed the hooks. (Clipping a group once all its uses are
seen, and what is left after the backward pass: :mod:`.clipping`.)
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..layers import UnsupportedModuleError
from ..layers.base import named_refusal
from ..layers.grads import (
    FactoredGrad,
    IndexFactor,
    InstantiatedGrad,
    PerExampleGrad,
    Units,
    group_units,
    instantiate,
    merge_repeated_ids,
    norm_sq,
    weighted_sum,
)
from .checkpointing import backward_keeping_grads, graph_leaves, own_saved_tensors, rerun_without_reentrant
from .packed import crossing_error, packed_grads, support_examples
from .rows import closed_form_grads, foreign_rows
from .state import Pass, Use, grad_stamp

#: The clipper's logger (these messages are about its calls).
logger = logging.getLogger("hf_dp.engine.clipper")

__all__ = ["BackwardBookkeeping"]


class BackwardBookkeeping:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: what happens in and after the backward pass."""

    # ------------------------------------------------------------------ prepare
    def _begin(self, per_example_loss: Tensor, *, keep_all: bool, loss_scale: float | None = None, units=None) -> None:
        """Start book-keeping the backward pass of ``per_example_loss`` (``prepare()``; ``keep_all``: keep every
        use's per-example gradients to the end, for the self-check's norms-only pass, which runs its own backward)."""
        p = self._checked_pass(per_example_loss, loss_scale)
        self._set_units(p, units, per_example_loss.device)
        p.keep_all = keep_all or (self.mode == "ghost" and not self._sum_checked)
        p.hooked = self._current_grad_hooks()  # applied per example before the norms (grad_hooks)
        self._start_groups(p, per_example_loss.device, loss_scale, keep_all)
        self._check_unwritten(p)
        if p.regions and not keep_all and per_example_loss.requires_grad:
            self._check_graph_for_bypass(per_example_loss)
        if not self._support_checked and p.examples > 1 and p.uses:
            self._support_check(per_example_loss)
            self._support_checked = True
        if not keep_all and p.size > 0:
            self._note_grads_before(p)
        p.phase = "record" if p.size > 0 else None
        self._prepared = True

    def _checked_pass(self, per_example_loss: Tensor, loss_scale: float | None) -> Pass:
        """The forward pass that ``per_example_loss`` comes from, once the loss and the call are checked."""
        if loss_scale is not None and not loss_scale > 0:
            raise ValueError(f"`loss_scale` must be > 0, got {loss_scale}.")
        if per_example_loss.dim() != 1:
            raise ValueError(
                f"`per_example_loss` must have shape [B] (one loss per example), got {tuple(per_example_loss.shape)}. "
                "A batch-mean loss couples examples and voids the DP bound."
            )
        if self._prepared:
            raise ValueError("`prepare()` was called twice; call `finish()` after each backward pass.")
        p = self._pass
        if p is None or not p.complete:
            raise ValueError(
                "`prepare()` needs a forward pass of the model with gradients enabled since the last `finish()` "
                "(the loss must come from that forward pass)."
            )
        if per_example_loss.shape[0] != p.examples:
            where = "sequences in its packed rows" if p.segments is not None else "examples (dimension 0 of its inputs)"
            raise ValueError(
                f"`per_example_loss` has {per_example_loss.shape[0]} entries but the model's forward pass had "
                f"{p.examples} {where}: hf_dp needs one loss per example, with the examples along dimension 0 of "
                "every input (or, with `packed_sequences=True`, one loss per sequence of the rows)."
            )
        if self.mode == "ghost" and p.size > 0 and not per_example_loss.requires_grad:
            raise ValueError("`per_example_loss` does not require grad.")
        return p

    @staticmethod
    def _set_units(p: Pass, units, device: torch.device) -> None:
        """The privacy units of the pass's examples (``None``: one unit per example)."""
        p.units = None
        if units is not None and p.segments is not None:
            raise ValueError("`units` with packed sequences: privacy units over the sequences are not supported.")
        if units is not None:
            if len(units) != p.size:
                raise ValueError(f"`units` has {len(units)} entries for {p.size} examples: give one unit per example.")
            grouping = Units.of(units, device)
            p.units = None if grouping.trivial else grouping

    def _start_groups(self, p: Pass, device: torch.device, loss_scale: float | None, keep_all: bool) -> None:
        """The clipping groups' book-keeping for the backward pass: the uses each group waits for, its squared norms
        and coefficients (zeros), and whether it is clipped inside the backward pass (in the hook of its last use)."""
        num_groups = len(self._groups)
        counts: dict[int, int] = defaultdict(int)  # id(parameter) -> its uses (ids: no Python hash per lookup)
        pending = [0] * num_groups
        group_of = self._group_of
        for use in p.uses:
            # one group (all-layer): every use is in group 0, not looked up per parameter
            use.groups = (0,) if num_groups == 1 else tuple(sorted({group_of[q] for q in use.params}))
            for q in use.params:
                counts[id(q)] += 1
            for g in use.groups:
                pending[g] += 1
        p.use_counts = counts
        p.pending, p.done, p.pieces = pending, [False] * num_groups, {}
        p.norm_sq = torch.zeros(num_groups, p.num_units, dtype=self._norm_dtype, device=device)
        p.coef = torch.zeros(num_groups, p.num_units, dtype=self._norm_dtype, device=device)
        p.loss_scale = loss_scale
        p.in_hook = num_groups > 1 and loss_scale is not None and not p.keep_all and self.mode != "ghost"
        if num_groups > 1 and loss_scale is None and not keep_all and not self._warned_scale:
            self._warned_scale = True
            logger.warning(
                "hf_dp: %d clipping groups, but `prepare()` got no `loss_scale`: the groups are clipped after the "
                "backward pass (exact, without the memory saving of clipping each group in its hook). Pass "
                "`prepare(loss, loss_scale=w)`.",
                num_groups,
            )

    def _note_grads_before(self, p: Pass) -> None:
        """``p.grad`` before the backward pass: kept aside in ``ghost`` mode (its first backward must not add into the
        accumulated gradients), else stamped (to find a gradient that bypassed the clipper)."""
        if self.mode == "ghost":
            p.grads_before = {q: q.grad for q in self._trainable}
            for q in self._trainable:  # the first backward must not add into the accumulated gradients
                q.grad = None
        else:
            p.grads_before = {q: grad_stamp(q) for q in self._trainable}

    # ------------------------------------------------------------------ backward
    def _on_output_grads(self, use: Use, positions: list[int], grads) -> None:
        full = [None] * len(use.layout.outputs)
        for j, g in zip(positions, grads, strict=True):
            full[j] = g
        self._on_grad(use, full)

    def _on_output_grad(self, use: Use, positions: list[int] | None, grad: Tensor) -> None:
        if positions is None:
            self._on_grad(use, grad)
        else:
            full = [None] * len(use.layout.outputs)
            full[positions[0]] = grad
            self._on_grad(use, full)

    def _on_root_grad(self, use: Use, shape, grad: Tensor) -> None:
        """The output hook of a closed-form call on the base of its output (a whole view of it, ``shape``)."""
        self._on_grad(use, grad.view(shape) if grad.is_contiguous() else grad.reshape(shape))

    def _check_unwritten(self, p: Pass) -> None:
        """Before the backward pass: no hooked output whose hook an in-place write drops was written in place after
        its module returned (its gradient would not reach the hook: a layer silently missing, DESIGN §19)."""
        for use in p.uses:
            written = any(t._version != v for t, v in use.versions)
            use.versions = []
            if written:
                raise UnsupportedModuleError(
                    f"The output of `{use.entry.name}` ({type(use.entry.module).__name__}) is written in place "
                    "after the module returned it (e.g. `h /= 2`, `h[mask] = ...`): hf_dp would not see its output "
                    "gradient. Make that write out of place in the caller (`h = h / 2`, `torch.where`), freeze "
                    "the module's parameters, or give it a closed-form rule. Nothing was added to `p.grad`."
                )

    def _on_grad(self, use: Use, grad) -> None:
        p = self._pass
        if p is None or p.phase is None or self._internal:  # (the engine's own backward passes: hooks stand aside)
            return
        if p.recomputing:
            self._check_reentrant_task(use)
        if p.phase == "support":
            self._check_support(use, grad)
            return
        if use.processed:
            return
        if use.captured is None:
            if use.region is not None:  # checkpointed: its inputs come with the region's recomputation
                use.pending_grad = grad
            return
        use.processed = True
        p.grad_events += 1
        with own_saved_tensors():  # a recomputation may be in progress (its inputs just arrived)
            try:
                self._process(p, use, grad)
            except UnsupportedModuleError as err:  # a rule's refusal knows the module, not its path: name it
                named = named_refusal(err, use.entry.name, use.entry.module)
                if named is err:
                    raise
                raise named from err

    def _process(self, p, use: Use, grad) -> None:
        grads = self._per_example_grads(use, grad)
        use.captured = None  # the factors keep what the clipped sum needs; drop the rest
        group_of, use_counts, hooked = self._group_of, p.use_counts, p.hooked
        single = not p.keep_all
        for q, g in grads.items():
            if single and use_counts.get(id(q), 0) == 1 and not (hooked and q in hooked):
                # added to the group's norm once, when it is clipped (one stack-sum instead of an add per parameter;
                # the instantiated ones side by side, one square-sum for all of them)
                if isinstance(g, InstantiatedGrad):
                    p.norm_dense.setdefault(group_of[q], []).append(g.value)
                else:
                    p.norm_parts.setdefault(group_of[q], []).append(norm_sq(g, self._norm_dtype, clamp=False))
                if self.mode == "ghost":  # norms only: the second backward forms the sum
                    continue
            p.pieces.setdefault(q, []).append(g)
        del grads
        if p.in_hook:
            self._use_done(p, use.groups)

    def _per_example_grads(self, use: Use, grad) -> dict[nn.Parameter, PerExampleGrad]:
        entry, b = use.entry, self._pass.size
        # a rule reads its module's parameters now: FSDP2 may hold the sharded twin of a used parameter again
        trainable = set(use.params) | {self._registered[q] for q in use.params if q in self._registered}
        with self._inert(), torch.no_grad():
            if entry.is_fallback:
                with rerun_without_reentrant(entry.module, entry.name):
                    try:
                        grads = entry.rule.per_example_grads(entry.module, use.captured, grad, trainable)
                    except UnsupportedModuleError:
                        raise
                    except Exception as err:  # the model's own code, failing on one example: say where and why
                        raise UnsupportedModuleError(
                            f"The torch.func fallback could not re-run `{entry.name}` ({type(entry.module).__name__}) "
                            f"on one example of the batch ({type(err).__name__}: {' '.join(str(err).split())[:300]}). "
                            "Its forward pass needs something of the whole batch that hf_dp passed per example, or "
                            "keeps state across calls. Freeze that module's parameters, or register a closed-form "
                            "rule for it (`hf_dp.layers.register_rule`). Nothing was added to `p.grad`."
                        ) from err
            elif self._pass.segments is not None:  # the examples are the sequences of the rows
                segments = self._pass.segments
                grads = packed_grads(entry, use.captured, grad, use.layout.outputs[0], b, segments, trainable)
            else:
                grads = closed_form_grads(
                    entry.rule, entry.module, use.captured, grad, use.layout.outputs[0], b, trainable
                )
        if self._used_of:
            grads = {self._used_of.get(id(q), q): g for q, g in grads.items()}
        missing = [q for q in use.params if q not in grads]
        if missing:
            names = self._names()[1]
            raise UnsupportedModuleError(
                f"The rule {type(entry.rule).__name__} of `{entry.name}` returned no per-example gradient for "
                f"{[names.get(q, '?') for q in missing][:3]}, which it covers: nothing was added to `p.grad` (a "
                "missing gradient would count as zero and silently leave the parameter out of its norm)."
            )
        units = self._pass.units
        if units is not None:  # one gradient per privacy unit, the sum of its examples' (before the cost choice)
            grads = {q: group_units(g, units) for q, g in grads.items()}
        mode = self.mode
        choose = mode in ("bk-mixopt", "per-sample")
        for q, g in grads.items():  # (in place: the same keys)
            if not isinstance(g, FactoredGrad):
                continue
            if isinstance(g.left, IndexFactor) or isinstance(g.right, IndexFactor):
                g = merge_repeated_ids(g)  # embedding rows of one id added first
            if choose and (mode == "per-sample" or g.prefers_instantiation()):
                g = instantiate(g, g.left.dtype if isinstance(g.left, Tensor) else g.right.dtype)
            grads[q] = g
        return grads

    def _check_support(self, use: Use, grad) -> None:
        p = self._pass
        grads = grad if isinstance(grad, list) else [grad]
        layouts = use.layout.outputs
        for g, lay in zip(grads, layouts, strict=False):
            if g is None or lay is None:
                continue
            # a device count, read with all the others after the check's backward passes (one host read, not one
            # per hooked output)
            if p.segments is None:
                count = foreign_rows(g, lay, p.size, p.support_example)
            else:
                count = p.segments.foreign(g, lay, p.size, p.support_example, use.entry)
            if count is not None:
                p.support_flags.append((use.entry.name, count))

    def _support_check(self, loss: Tensor) -> None:
        """Loss ``j`` must depend on example ``j``'s rows alone in every hooked output (checked for the first and
        the last example, once per plan): a loss that couples examples, or root inputs that are not batch-first,
        fail here instead of giving wrong norms."""
        p = self._pass
        if p.examples < 2 or not loss.requires_grad or not p.uses:
            return
        self._check_own_passes("check that each loss depends on its own example")
        inputs = list(self._origins.values()) + [q for q in self._trainable if q.requires_grad]
        p.phase = "support"
        stamps = {q: grad_stamp(q) for q in self._trainable}
        try:
            for j in support_examples(p):
                p.support_example = j
                if any(r.reentrant for r in p.regions.values()):  # reentrant checkpointing refuses autograd.grad
                    backward_keeping_grads(loss[j], retain_graph=True)
                else:
                    torch.autograd.grad(loss[j], inputs, allow_unused=True, retain_graph=True)
                self._recompute_leave()  # a checkpointed region's recomputation switched the parameters off
        finally:
            self._recompute_leave()
            p.phase = None
            for origin in self._origins.values():
                origin.grad = None
        self._refuse_autograd_writes(stamps, set())
        if p.support_flags:
            names = [name for name, _ in p.support_flags]
            device = p.support_flags[0][1].device
            counts = [c if c.device == device else c.to(device) for _, c in p.support_flags]
            p.support_failures += [name for name, n in zip(names, torch.stack(counts).tolist(), strict=True) if n > 0]
            p.support_flags = []
        if p.support_failures:
            modules = sorted(set(p.support_failures))
            if p.segments is not None:
                raise crossing_error(modules)
            raise UnsupportedModuleError(
                f"The per-example loss of one example depends on the rows of other examples in the outputs of "
                f"{modules[:3]}{' ...' if len(modules) > 3 else ''}: either the loss couples examples (a batch mean "
                "or normalisation: compute one loss per example), or the model's inputs do not carry the examples "
                "along dimension 0 (e.g. [T, B, ...]: pass batch-first inputs)."
            )

    def _check_no_bypass(self, p: Pass) -> None:
        """In the one-backward modes autograd never writes ``p.grad``; if it did, a use of the parameter bypassed
        the hooks (e.g. inside the loss, after the model's forward pass) and would leak an unclipped gradient."""
        if self.mode == "ghost" or p.grads_before is None:
            return
        self._refuse_autograd_writes(p.grads_before, p.bypassed)

    def _refuse_autograd_writes(self, stamps: dict, bypassed: set) -> None:
        """Raise if autograd wrote a ``p.grad`` since ``stamps`` (a use the hooks do not see); a ``p.grad`` that was
        empty is emptied again first, so that autograd's un-clipped gradient does not stay there."""
        bypassed = [q for q, stamp in stamps.items() if q in bypassed or grad_stamp(q) != stamp]
        if not bypassed:
            return
        for q in bypassed:
            if stamps[q][0] is None:
                q.grad = None
        raise UnsupportedModuleError(
            f"Trainable parameter `{self._names()[1].get(bypassed[0], '?')}` received a gradient from autograd during "
            "the backward pass: it is used outside the model's forward pass (e.g. in the loss, or recomputed by a "
            "checkpoint function hf_dp does not know), where its gradient would not be clipped. Compute the "
            "per-example loss from the model's outputs only, and checkpoint with `torch.utils.checkpoint`."
        )

    def _check_graph_for_bypass(self, loss: Tensor) -> None:
        """With activation checkpointing the parameters stay out of autograd from a region's recomputation to
        ``finish()``, and autograd then skips (silently) the gradient of a parameter used outside the model's forward
        pass: look for such a use in the loss's graph before the backward pass instead (a node accumulating into a
        trainable parameter; ghost differentiation leaves none for the uses the hooks cover)."""
        trainable = {id(q): q for q in self._trainable}
        for var in graph_leaves(loss):
            if trainable.get(id(var)) is var:
                raise UnsupportedModuleError(
                    f"Trainable parameter `{self._names()[1].get(var, '?')}` is used outside the model's forward pass "
                    "(e.g. in the loss), where its gradient would not be clipped. Compute the per-example loss from "
                    "the model's outputs only."
                )

    def _check_ghost_sums(self, p: Pass, pieces: dict[nn.Parameter, list[PerExampleGrad]]) -> None:
        """Once per plan in ghost mode: autograd's gradient of the summed loss must equal the sum of the engine's
        per-example gradients (otherwise a use escaped the hooks, e.g. in the loss)."""
        if self._sum_checked:
            return
        self._sum_checked = True
        ones = torch.ones(p.num_units, dtype=self._norm_dtype, device=p.norm_sq.device)
        _, param_names = self._names()
        # a gradient that is zero in theory (a key bias under softmax) is round-off on both sides: floor the scale at
        # a share of the whole gradient's that is above the round-off of its precision
        total = float(sum(float(q.grad.double().norm()) ** 2 for q in self._trainable if q.grad is not None)) ** 0.5
        floor = (1e-6 if self._norm_dtype == torch.float64 else 1e-3) * total
        for q in self._trainable:
            expected = q.grad
            got = p.hook_sums.get(q)  # a hooked parameter: autograd ran its hooks on the sum
            for g in pieces.get(q, []) if got is None else ():
                part = weighted_sum(g, ones, torch.float64)
                got = part if got is None else got + part
            if expected is None and got is None:
                continue
            expected = torch.zeros_like(got) if expected is None else expected.double()
            got = torch.zeros_like(expected) if got is None else got
            scale, diff = max(float(expected.norm()), floor), float((got - expected).norm())
            # (`not diff <= ...`: a NaN in the engine's sum against autograd's finite gradient fails, not passes)
            if not (diff <= 1e-3 * max(scale, 1e-12) or diff <= 1e-30) and math.isfinite(scale):
                raise UnsupportedModuleError(
                    f"Trainable parameter `{param_names.get(q, '?')}` gets a gradient that no hooked module accounts "
                    "for (it is used outside the model's forward pass, e.g. in the loss, or recomputed by a checkpoint "
                    "function hf_dp does not know): its per-example norm would be wrong. Compute the per-example loss "
                    "from the model's outputs only, and checkpoint with `torch.utils.checkpoint`."
                )
        for q in list(pieces):
            if p.use_counts.get(id(q), 0) == 1 and q not in p.hooked:  # a hooked one's clipped sum is the engine's
                pieces.pop(q)

    # ------------------------------------------------------------------ self-check support
    def _parameter_norms(
        self, inputs: dict, per_example_loss: Callable[[nn.Module, dict], Tensor]
    ) -> dict[nn.Parameter, Tensor]:
        """Per-parameter per-example gradient norms of ``per_example_loss(model, inputs)``, without touching
        ``p.grad`` or the state of the current micro-batch."""
        saved = (self._pass, self._prepared, self._capturing, self.per_example_norms, self.per_group_norms)
        self._pass, self._prepared, self._capturing = None, False, False
        self._force_ghost_diff = True
        stamps = {q: grad_stamp(q) for q in self._trainable}
        try:
            loss = per_example_loss(self.model, inputs)
            self._begin(loss, keep_all=True)
            p = self._pass
            # the origins give a graph to outputs that had none; where the inputs require grad (peft's
            # `enable_input_require_grads`, which gradient checkpointing turns on) the graph's own leaves do
            leaves = [*self._origins.values(), *(v for v in graph_leaves(loss) if v.requires_grad)]
            if p.size and p.uses and any(r.reentrant for r in p.regions.values()):
                backward_keeping_grads(loss.sum())  # reentrant checkpointing refuses `inputs=`
            elif p.size and p.uses and leaves:
                torch.autograd.backward(loss.sum(), inputs=leaves)
            p.phase = None
            self._refuse_autograd_writes(stamps, set())
            out = {}
            with torch.no_grad():
                for q in list(p.pieces):
                    parts = p.pieces.pop(q)
                    parts = [self._hooked_grad(p, q, parts)] if q in p.hooked else parts
                    out[q] = self._merged_norm_sq(parts)[0].sqrt()
            return out
        finally:
            self._force_ghost_diff = False
            self._recompute_leave()
            for origin in self._origins.values():
                origin.grad = None
            self._pass, self._prepared, self._capturing, self.per_example_norms, self.per_group_norms = saved
