"""Clipping the book-kept per-example gradients of one clipping group and delivering the clipped sum.

A group (:mod:`.policy`) is clipped once every use of its parameters recorded in the forward pass has received its
output gradient: with several groups (layer-wise, param-wise, named groups) that happens inside the backward pass, in
the hook of the group's last use, and the group's book-kept factors are freed right there (memory close to
non-private: only the groups still waiting hold factors); with one group (all-layer) after the backward pass. No hook
order is assumed: a group whose uses are not all seen waits, and whatever is left is clipped in ``finish()`` (a use
whose output never received a gradient contributes nothing).

For a parameter used several times the group's squared norm gets ``||sum_k G_k||^2`` (uses of the same kind merged
exactly, :func:`~hf_dp.layers.grads.merge`, the rest through the cross terms ``2 <G_k, G_l>``; DESIGN §4.2).
``"ghost"`` mode (one group) instead reweights the loss and runs a second backward pass.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..layers import UnsupportedModuleError
from ..layers.grads import (
    FactoredGrad,
    IndexFactor,
    InstantiatedGrad,
    PerExampleGrad,
    inner,
    merge,
    norm_sq,
    weighted_sum,
)
from .state import Pass, grad_stamp

__all__ = ["GroupClipping"]

#: Instantiated gradients of at most this many entries per example are normed and summed side by side (one op for
#: all of a group's biases and norm weights; larger ones on their own, so that nothing large is copied).
SIDE_BY_SIDE = 1 << 16
#: A per-example gradient with a dense factor of more bytes than this is masked and summed over chunks of examples,
#: so that the masked copy stays this small (the lm_head's ``[B, T, V]`` output gradient would be copied whole), in
#: at most ``MAX_CHUNKS`` chunks (a copy of an eighth of a larger factor; a few more launches, not one per example).
CHUNK_BYTES = 16 << 20
MAX_CHUNKS = 8


class GroupClipping:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: clip a group, hand its clipped sum over."""

    def _merged_norm_sq(self, parts: list[PerExampleGrad]) -> tuple[Tensor, list[PerExampleGrad]]:
        """``||sum_k G_k||^2`` per example for the per-use gradients of one parameter, and the merged pieces."""
        parts = merge(parts) if len(parts) > 1 else parts
        total = None
        for k, gk in enumerate(parts):
            term = norm_sq(gk, self._norm_dtype)
            for gl in parts[k + 1 :]:
                term = term + 2 * inner(gk, gl, self._norm_dtype)
            total = term if total is None else total + term
        return total, parts

    def _group_pieces(self, p: Pass, g: int) -> dict[nn.Parameter, list[PerExampleGrad]]:
        """Take the book-kept pieces of group ``g`` out of the pass, adding the norms of shared parameters."""
        parts = p.norm_parts.pop(g, [])
        dense = p.norm_dense.pop(g, None)
        if dense:  # the group's small instantiated gradients side by side: one square-sum (large ones: their own)
            flat = [v if v.dim() == 2 else v.reshape(v.shape[0], -1) for v in dense]
            small = [v for v in flat if v.shape[1] <= SIDE_BY_SIDE]
            for v in [v for v in flat if v.shape[1] > SIDE_BY_SIDE] + ([torch.cat(small, 1)] if small else []):
                parts.append(v.to(self._norm_dtype).pow(2).sum(1))
            del flat, small
        if parts:  # the group's single-use terms, unclamped: one sum, clamped once (ghost products round below 0)
            p.norm_sq[g].add_(parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)).clamp_min_(0)
        pieces = {}
        for q in self._groups.params[g]:
            parts = p.pieces.pop(q, None)
            if not parts:
                continue
            if p.hooked and q in p.hooked:  # h(g_i) of every example, before its norm is taken (grad_hooks)
                parts = [self._hooked_grad(p, q, parts)]
                p.norm_sq[g].add_(norm_sq(parts[0], self._norm_dtype))
            elif p.use_counts.get(id(q), 0) > 1 or p.keep_all:
                extra, parts = self._merged_norm_sq(parts)
                p.norm_sq[g].add_(extra)  # in place on the row (`+=` on an index also copies it back)
            pieces[q] = parts
        return pieces

    def _finalize_group(self, p: Pass, g: int) -> None:
        """Clip group ``g`` at ``C_g`` and deliver its clipped sum, parameter by parameter, freeing as it goes."""
        with torch.no_grad():
            pieces = self._group_pieces(p, g)
            registered = self._registered
            norms = p.norm_sq[g].sqrt() / (p.loss_scale or 1.0)
            coef = self.policy.coefficients(norms, len(self._groups))
            # examples whose norm is not finite are masked on the device (no host sync to ask whether any is)
            keep = torch.isfinite(norms)
            zeros: dict = {}  # per dtype: a zero; per number of dimensions: `keep` shaped for it
            views: dict = {}  # per dtype: the coefficients cast and shaped for a factor
            p.coef[g] = coef
            sums = self._small_sums(pieces, coef, keep)
            for q in self._groups.params[g]:
                parts = pieces.pop(q, None)
                total = sums.pop(q, None)
                # the dtype of the parameter the optimizer steps on (FSDP2 may compute in a lower one)
                dtype = (registered.get(q, q) if registered else q).dtype
                if parts and total is None:
                    total = _clipped_sum(parts[0], coef, keep, dtype, zeros, views)
                    for part in parts[1:]:
                        total += _clipped_sum(part, coef, keep, dtype, zeros, views)
                    del parts
                self._deliver(p, q, total)
        p.done[g] = True

    def _small_sums(self, pieces: dict, coef: Tensor, keep: Tensor) -> dict[nn.Parameter, Tensor]:
        """The clipped sums of the group's small instantiated gradients (biases, norm weights), side by side per
        dtype: one mask and one matrix-vector product for all of them (taken out of ``pieces``)."""
        by_dtype: dict[torch.dtype, list] = {}
        registered = self._registered
        for q, parts in pieces.items():
            if len(parts) == 1 and isinstance(parts[0], InstantiatedGrad):
                v = parts[0].value
                if v.dim() >= 2 and math.prod(v.shape[1:]) <= SIDE_BY_SIDE:
                    by_dtype.setdefault((registered.get(q, q) if registered else q).dtype, []).append((q, v))
        sums = {}
        for dtype, entries in by_dtype.items():
            if len(entries) < 2:
                continue
            flat = torch.cat([v if v.dim() == 2 else v.reshape(v.shape[0], -1) for _, v in entries], 1).to(dtype)
            flat = torch.where(keep.view(-1, 1), flat, torch.zeros((), dtype=dtype, device=flat.device))
            total = torch.mv(flat.t(), coef.to(dtype))
            for (q, v), part in zip(entries, total.split([math.prod(v.shape[1:]) for _, v in entries]), strict=True):
                sums[q] = part if v.dim() == 2 else part.view(v.shape[1:])
                del pieces[q]
        return sums

    def _deliver(self, p: Pass, q: nn.Parameter, total: Tensor | None) -> None:
        """``grad_sink(q, total)`` (zeros for a parameter no use reached), else ``q.grad += total``."""
        if self.grad_sink is not None:
            dtype = self._registered.get(q, q).dtype
            self.grad_sink(q, torch.zeros_like(q, dtype=dtype) if total is None else total)
            return
        if total is None:
            return
        stamps = p.grads_before if self.mode != "ghost" else None
        if stamps is not None and grad_stamp(q) != stamps.get(q):
            p.bypassed.add(q)  # autograd wrote p.grad during this backward: reported by `_check_no_bypass`
        q.grad = total if q.grad is None else q.grad + total
        if stamps is not None:
            stamps[q] = grad_stamp(q)

    def _use_done(self, p: Pass, groups: tuple[int, ...]) -> None:
        """One more use of ``groups`` has its per-example gradients: clip the groups that have all of theirs."""
        for g in groups:
            p.pending[g] -= 1
            if p.pending[g] == 0 and not p.done[g]:
                self._finalize_group(p, g)

    def _finish(self, p: Pass, per_example_loss: Tensor | None, loss_scale: float | None) -> Tensor:
        """``finish()`` once its arguments are checked: after the checks that the backward pass reached the hooks
        and nothing bypassed them, the groups not clipped inside the backward pass are clipped and delivered, and the
        norms set; the clipping coefficients."""
        p.loss_scale = loss_scale if p.loss_scale is None else p.loss_scale
        scale = p.loss_scale or 1.0
        for origin in self._origins.values():
            origin.grad = None
        if p.size == 0:
            self.per_example_norms = p.norm_sq.sum(0)
            self.per_group_norms = p.norm_sq
            if self.grad_sink is not None:
                for q in self._trainable:
                    self._deliver(p, q, None)
            return p.coef[0] if len(self._groups) == 1 else p.coef
        if p.uses and p.grad_events == 0:
            raise ValueError(
                "No hooked module received an output gradient in the backward pass: the per-example loss does not "
                "depend on the model's forward pass since `prepare()` (e.g. a `compute_loss` that bypassed the "
                "per-example loss), or the backward pass did not run. Nothing was added to `p.grad`."
            )
        self._check_no_bypass(p)
        if any(use.pending_grad is not None for use in p.uses):
            names = sorted({use.entry.name for use in p.uses if use.pending_grad is not None})
            raise UnsupportedModuleError(
                f"The checkpointed calls of {names[:3]} received their output gradients, but their region was never "
                "recomputed in the backward pass, so their inputs were never book-kept. Nothing was added to "
                "`p.grad`; turn activation checkpointing off for these modules."
            )
        p.uses = []
        if self.mode == "ghost":
            return self._finish_ghost(p, per_example_loss, scale)
        with torch.no_grad():
            for g in range(len(self._groups)):
                if not p.done[g]:
                    self._finalize_group(p, g)
            self.per_group_norms = p.norm_sq.sqrt() / scale
            self.per_example_norms = p.norm_sq.sum(0).sqrt() / scale
        coef = p.coef.detach()
        return coef[0] if len(self._groups) == 1 else coef

    def _finish_ghost(self, p: Pass, per_example_loss: Tensor | None, scale: float) -> Tensor:
        """GhostClip: norms from the first backward (one group), then a second backward of the reweighted loss."""
        with torch.no_grad():
            pieces = self._group_pieces(p, 0)
            norms = p.norm_sq.sum(0).sqrt() / scale
            coef = self.policy.coefficients(norms, 1)
            self.per_example_norms = norms.detach()
            self.per_group_norms = p.norm_sq.sqrt() / scale
            self._check_ghost_sums(p, pieces)
            # hooked parameters: sum_i c_i h(g_i), never autograd's h(sum_i c_i g_i) (no op when nothing is hooked)
            keep = torch.isfinite(norms) if p.hooked else None
            hooked = {
                q: weighted_sum(parts[0], coef, self._registered.get(q, q).dtype, keep)
                for q, parts in pieces.items()
                if q in p.hooked
            }
            del pieces
        if per_example_loss is None:
            raise ValueError("`ghost` mode needs the per-example loss again for its second backward pass.")
        for q in self._trainable:  # drop the first backward's unclipped sums (checked above)
            q.grad = None
        weights = coef if p.units is None else coef[p.units.index]  # each example takes its unit's coefficient
        with self._inert():
            (per_example_loss * weights.to(per_example_loss.dtype)).sum().backward()
        for q in self._trainable:
            total = hooked.get(q, q.grad.detach() if q.grad is not None else None)
            q.grad = p.grads_before[q]
            self._deliver(p, q, total)
        return coef.detach()


def _clipped_sum(
    grad: PerExampleGrad, coef: Tensor, keep: Tensor, dtype: torch.dtype, zeros: dict, views: dict
) -> Tensor:
    """``sum_{i in keep} coef_i G_i``: in one go, or over chunks of examples for a gradient with a dense factor over
    :data:`CHUNK_BYTES` (the masked and scaled copies are then one chunk's; the result is the same sum)."""
    dense = [f for f in _factors(grad) if isinstance(f, Tensor)]
    units = coef.shape[0]
    largest = max((f.numel() * f.element_size() for f in dense), default=0)
    if largest <= CHUNK_BYTES or units < 2 or any(f.dim() == 0 or f.shape[0] != units for f in dense):
        return weighted_sum(_masked(grad, keep, zeros), coef, dtype, views=views)
    rows = max(1, units * CHUNK_BYTES // largest, -(-units // MAX_CHUNKS))
    total = None
    for start in range(0, units, rows):
        end = min(start + rows, units)
        part = weighted_sum(_masked(_examples(grad, start, end), keep[start:end], {}), coef[start:end], dtype)
        total = part if total is None else total.add_(part)
    return total


def _factors(grad: PerExampleGrad) -> tuple:
    return (grad.value,) if isinstance(grad, InstantiatedGrad) else (grad.left, grad.right)


def _examples(grad: PerExampleGrad, start: int, end: int) -> PerExampleGrad:
    """The per-example gradients of examples ``start .. end - 1`` (views, no copy)."""

    def rows(f):
        if isinstance(f, IndexFactor):
            return IndexFactor(f.index[start:end], f.size, f.distinct)
        return f[start:end]

    if isinstance(grad, InstantiatedGrad):
        return InstantiatedGrad(grad.value[start:end])
    return FactoredGrad(rows(grad.left), rows(grad.right), grad.shape)


def _masked(grad: PerExampleGrad, keep: Tensor, zeros: dict) -> PerExampleGrad:
    """``grad`` with the examples not in ``keep`` zeroed in every dense factor (``inf * 0`` would still be nan): the
    same sums as ``weighted_sum(grad, coef, dtype, keep)``, one ``where`` per factor and one zero per dtype."""

    def mask(f):
        if isinstance(f, IndexFactor):
            return f
        zero = zeros.get(f.dtype)
        if zero is None:
            zero = zeros[f.dtype] = torch.zeros((), dtype=f.dtype, device=f.device)
        shaped = zeros.get(f.dim())  # keep, shaped to broadcast over a factor of this many dimensions
        if shaped is None:
            shaped = zeros[f.dim()] = keep.view((-1,) + (1,) * (f.dim() - 1))
        return torch.where(shaped, f, zero)

    if isinstance(grad, InstantiatedGrad):
        return InstantiatedGrad(mask(grad.value))
    return FactoredGrad(mask(grad.left), mask(grad.right), grad.shape)
