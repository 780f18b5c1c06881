"""Per-example gradients in the two forms book-keeping works with, and their algebra.

A rule describes the gradient of one parameter for each example ``i`` of a batch either as

* :class:`FactoredGrad`: ``G_i = sum_t L_{i,t} R_{i,t}^T`` (a sum of outer products over the ``T`` positions of a
  sequence layer; ``L`` are the row factors, ``R`` the column factors), never formed unless asked; or
* :class:`InstantiatedGrad`: ``G_i`` itself, a tensor ``[B, *param.shape]``.

A factor is either dense, ``[B, T, n]``, or an :class:`IndexFactor` (one-hot rows given by integer ids, as for an
embedding table; id ``-1`` marks a position that contributes nothing, e.g. ``padding_idx``).

The ghost-norm identity (Li et al. 2022, eq. 3; Bu et al. 2023):
``<G_i, H_i> = sum_{t,s} (L_t . L'_s)(R_t . R'_s)``, so ``||G_i||^2`` costs ``O(T^2 (r + c))`` instead of ``O(r c)``.
With one-hot factors the first Gram matrix is ``[id_t == id'_s]``, which merges repeated token ids exactly.

Rules and the engine both read this module (it imports nothing from either).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "FactoredGrad",
    "IndexFactor",
    "InstantiatedGrad",
    "PerExampleGrad",
    "Units",
    "compute_dtype",
    "fold",
    "group_units",
    "inner",
    "instantiate",
    "merge",
    "merge_repeated_ids",
    "norm_sq",
    "weighted_sum",
]


@functools.cache
def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types(a, b)``, cached on the host (the call dispatches an op each time)."""
    return torch.promote_types(a, b)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for norms and coefficients: at least float32; float64 stays float64."""
    return promote(dtype, torch.float32)


@dataclass
class IndexFactor:
    """One-hot factor: position ``t`` of example ``i`` is the unit vector ``e_{index[i, t]}`` of length ``size``."""

    index: Tensor  # [B, T] long, -1 = no contribution
    size: int
    distinct: bool = False  # no id repeats within an example (:func:`merge_repeated_ids`): its Gram is diagonal

    @property
    def batch_size(self) -> int:
        return self.index.shape[0]

    @property
    def length(self) -> int:
        return self.index.shape[1]


Factor = Tensor | IndexFactor


def _size(f: Factor) -> int:
    return f.size if isinstance(f, IndexFactor) else f.shape[-1]


def _length(f: Factor) -> int:
    return f.length if isinstance(f, IndexFactor) else f.shape[1]


@dataclass
class FactoredGrad:
    """``G_i = sum_t left[i, t] right[i, t]^T``, reshaped to ``shape``."""

    left: Factor
    right: Factor
    shape: torch.Size

    @property
    def rows(self) -> int:
        return _size(self.left)

    @property
    def cols(self) -> int:
        return _size(self.right)

    @property
    def length(self) -> int:
        return _length(self.left)

    def prefers_instantiation(self) -> bool:
        """BK-MixOpt rule (Bu et al. 2023, sec. 3.3): ghost norm costs ~2T^2 per example, instantiation r*c."""
        if isinstance(self.left, IndexFactor) or isinstance(self.right, IndexFactor):
            # An embedding table is instantiated only when it is tiny next to T^2.
            return 2 * self.length**2 > 4 * self.rows * self.cols
        return 2 * self.length**2 > self.rows * self.cols


@dataclass
class InstantiatedGrad:
    """Per-example gradients ``[B, *param.shape]``."""

    value: Tensor


PerExampleGrad = FactoredGrad | InstantiatedGrad


def _gram(f1: Factor, f2: Factor, dtype: torch.dtype) -> Tensor:
    """``[B, T1, T2]`` inner products between the positions of two factors of the same size."""
    if isinstance(f1, IndexFactor) and isinstance(f2, IndexFactor):
        eq = f1.index.unsqueeze(2) == f2.index.unsqueeze(1)
        valid = (f1.index >= 0).unsqueeze(2) & (f2.index >= 0).unsqueeze(1)
        return (eq & valid).to(dtype)
    if isinstance(f1, IndexFactor):
        return _gram(f2, f1, dtype).transpose(1, 2)
    if isinstance(f2, IndexFactor):
        # (f1_t . e_{id_s}) = f1[t, id_s]
        idx = f2.index.clamp_min(0)
        gathered = torch.gather(f1.to(dtype), 2, idx.unsqueeze(1).expand(-1, f1.shape[1], -1))
        return gathered * (f2.index >= 0).unsqueeze(1).to(dtype)
    return torch.bmm(f1.to(dtype), f2.to(dtype).transpose(1, 2))


def _densify_pair(left: Factor, right: Factor, dtype: torch.dtype) -> Tensor:
    """``[B, r, c]`` = sum_t left_t right_t^T."""
    if isinstance(left, IndexFactor) and isinstance(right, IndexFactor):
        raise ValueError("a factored gradient cannot have two one-hot factors")
    if isinstance(right, IndexFactor):
        return _densify_pair(right, left, dtype).transpose(1, 2)
    right = right.to(dtype)
    if isinstance(left, IndexFactor):
        valid = (left.index >= 0).unsqueeze(-1).to(dtype)
        out = right.new_zeros(right.shape[0], left.size, right.shape[2])
        idx = left.index.clamp_min(0).unsqueeze(-1).expand(-1, -1, right.shape[2])
        return out.scatter_add_(1, idx, right * valid)
    return torch.bmm(left.to(dtype).transpose(1, 2), right)


def instantiate(grad: PerExampleGrad, dtype: torch.dtype) -> InstantiatedGrad:
    """Form the per-example gradients ``[B, *shape]`` of a factored gradient."""
    if isinstance(grad, InstantiatedGrad):
        return grad
    dense = _densify_pair(grad.left, grad.right, dtype)
    return InstantiatedGrad(dense.reshape(dense.shape[0], *grad.shape))


def norm_sq(grad: PerExampleGrad, dtype: torch.dtype, *, clamp: bool = True) -> Tensor:
    """``[B]`` squared Frobenius norms, in ``dtype`` (clamped at 0: the ghost products can round below it; with
    ``clamp=False`` the caller clamps a sum of them once)."""
    if isinstance(grad, InstantiatedGrad):
        v = grad.value.to(dtype)
        return (v if v.dim() == 2 else v.reshape(v.shape[0], -1)).pow(2).sum(1)
    ids, dense = _one_hot_side(grad)
    if ids is not None and ids.distinct:  # one-hot Gram = diag(valid): ||G_i||^2 = sum_t valid_t |R_t|^2
        valid = (ids.index >= 0).to(dtype)
        return (dense.to(dtype).pow(2).sum(-1) * valid).sum(1)
    prod = _gram(grad.left, grad.left, dtype) * _gram(grad.right, grad.right, dtype)
    total = prod.sum((1, 2))
    return total.clamp_min(0) if clamp else total


def _one_hot_side(grad: FactoredGrad) -> tuple[IndexFactor | None, Tensor | None]:
    """``(ids, dense)`` of a factored gradient with exactly one one-hot factor, else ``(None, None)``."""
    if isinstance(grad.left, IndexFactor) and isinstance(grad.right, Tensor):
        return grad.left, grad.right
    if isinstance(grad.right, IndexFactor) and isinstance(grad.left, Tensor):
        return grad.right, grad.left
    return None, None


def merge_repeated_ids(grad: PerExampleGrad) -> PerExampleGrad:
    """The same gradient with the positions of an example that share an id (an embedding row) merged into one.

    ``sum_t e_{id_t} R_t^T = sum_v e_v (sum_{t: id_t = v} R_t)^T``: the dense rows of each id are added first (in
    float64), so that the norm no longer sums products of rows that nearly cancel (the same position id in the four
    choices of a multiple-choice example, whose output gradients sum to about zero, lost percents of the norm in
    float32 through the ``[id_t == id_s] (R_t . R_s)`` ghost products), and costs ``O(T n)`` instead of ``O(T^2 n)``.
    Sync-free: a sort of the ids, one gather and one scatter-add, all of fixed shape.
    """
    if not isinstance(grad, FactoredGrad):
        return grad
    ids, dense = _one_hot_side(grad)
    if ids is None or ids.distinct:
        return grad
    sorted_ids, order = ids.index.sort(dim=1)
    rows = torch.gather(dense, 1, order.unsqueeze(-1).expand(-1, -1, dense.shape[-1]))
    start = torch.ones_like(sorted_ids, dtype=torch.bool)
    start[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    segment = start.long().cumsum(1) - 1
    wide = promote(rows.dtype, torch.float64) if rows.device.type != "mps" else rows.dtype
    merged = torch.zeros(rows.shape, dtype=wide, device=rows.device)
    merged.scatter_add_(1, segment.unsqueeze(-1).expand_as(rows), rows.to(wide))
    # every position of a segment has the segment's id (-1 padding ids sort first and stay a no-contribution row)
    merged_ids = torch.full_like(sorted_ids, -1).scatter_(1, segment, sorted_ids)
    merged_ids = IndexFactor(merged_ids, ids.size, distinct=True)
    merged = merged.to(rows.dtype)
    if grad.left is ids:
        return FactoredGrad(merged_ids, merged, grad.shape)
    return FactoredGrad(merged, merged_ids, grad.shape)


def inner(a: PerExampleGrad, b: PerExampleGrad, dtype: torch.dtype) -> Tensor:
    """``[B]`` inner products ``<a_i, b_i>`` of two per-example gradients of the same parameter (cross terms)."""
    if isinstance(a, FactoredGrad) and isinstance(b, FactoredGrad):
        return (_gram(a.left, b.left, dtype) * _gram(a.right, b.right, dtype)).sum((1, 2))
    va = instantiate(a, dtype).value.to(dtype)
    vb = instantiate(b, dtype).value.to(dtype)
    return (va.reshape(va.shape[0], -1) * vb.reshape(vb.shape[0], -1)).sum(1)


def _scale(f: Factor, coef: Tensor, keep: Tensor | None, views: dict | None = None) -> Factor:
    if isinstance(f, IndexFactor):
        return f
    shaped = None if views is None else views.get(f.dtype)
    if shaped is None:
        shaped = coef.to(f.dtype).view(-1, 1, 1)
        if views is not None:
            views[f.dtype] = shaped
    return _mask(f * shaped, keep)


def _mask(f: Factor, keep: Tensor | None) -> Factor:
    """Zero the examples not in ``keep`` (non-finite gradients: ``inf * 0`` would still be nan)."""
    if keep is None or isinstance(f, IndexFactor):
        return f
    shape = (-1,) + (1,) * (f.dim() - 1)
    return torch.where(keep.view(shape), f, torch.zeros((), dtype=f.dtype, device=f.device))


def weighted_sum(
    grad: PerExampleGrad, coef: Tensor, dtype: torch.dtype, keep: Tensor | None = None, *, views: dict | None = None
) -> Tensor:
    """``sum_i coef_i G_i`` with the parameter's shape (book-keeping: one matmul over ``B*T`` rows).

    ``keep`` (``[B]`` bool, optional) marks the examples to include; pass it when some gradients are not finite.
    ``views`` (optional, one dict per ``coef``) caches ``coef`` cast and shaped per factor dtype.
    """
    if isinstance(grad, InstantiatedGrad):
        v = _mask(grad.value.to(dtype), keep)
        if v.dim() == 2:
            return torch.mv(v.t(), coef.to(dtype))
        return torch.mv(v.reshape(v.shape[0], -1).t(), coef.to(dtype)).view(v.shape[1:])
    left, right = grad.left, grad.right
    # the coefficients scale the smaller dense factor (a copy either way: the smaller one is the cheaper)
    if isinstance(right, IndexFactor) or (isinstance(left, Tensor) and left.numel() < right.numel()):
        left, right = _scale(left, coef, keep, views), _mask(right, keep)
    else:
        left, right = _mask(left, keep), _scale(right, coef, keep, views)
    if isinstance(left, IndexFactor):
        flat_right = right.to(dtype).reshape(-1, right.shape[-1])
        idx = left.index.reshape(-1)
        valid = idx >= 0
        out = flat_right.new_zeros(left.size, flat_right.shape[1])
        out.index_add_(0, idx[valid], flat_right[valid])
        return out.reshape(grad.shape)
    if isinstance(right, IndexFactor):
        flat_left = left.to(dtype).reshape(-1, left.shape[-1])
        idx = right.index.reshape(-1)
        valid = idx >= 0
        out = flat_left.new_zeros(right.size, flat_left.shape[1])
        out.index_add_(0, idx[valid], flat_left[valid])
        return out.t().reshape(grad.shape)
    flat_left = left.reshape(-1, left.shape[-1])
    flat_right = right.reshape(-1, right.shape[-1])
    common = promote(flat_left.dtype, flat_right.dtype)
    out = (flat_left.to(common).t() @ flat_right.to(common)).to(dtype)
    return out if out.shape == grad.shape else out.reshape(grad.shape)


def _fold_factor(f: Factor, batch_size: int) -> Factor:
    if isinstance(f, IndexFactor):
        return IndexFactor(f.index.reshape(batch_size, -1), f.size)
    return f.reshape(batch_size, -1, f.shape[-1])


def _fold_centred(left: Tensor, right: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
    """Fold ``k`` rows per example of two dense factors so that the ghost norm does not cancel.

    The rows of one example (the choices of a multiple-choice example, the images of one example) often share most of
    their inputs while their output gradients nearly sum to zero (a softmax over the rows): the per-example gradient
    is a small difference of large terms, and its ghost norm, a sum of products of large Gram entries, loses
    ``eps * (sum_r |L_r| |R_r|)^2 / ||G||^2`` of relative precision (percents in float32). With the mean over the
    rows ``Rbar_t = (1/k) sum_r R_{r,t}``, exactly
    ``sum_{r,t} L_{r,t} R_{r,t}^T = sum_t (sum_r L_{r,t}) Rbar_t^T + sum_{r,t} L_{r,t} (R_{r,t} - Rbar_t)^T``,
    whose factors are small where the rows agree: the norm then loses only what forming the gradient would.
    """
    k = left.shape[0] // batch_size
    lk = left.reshape(batch_size, k, *left.shape[1:])
    rk = right.reshape(batch_size, k, *right.shape[1:])
    mean = rk.mean(1, keepdim=True)
    new_left = torch.cat([lk.sum(1), lk.reshape(batch_size, -1, lk.shape[-1])], 1)
    new_right = torch.cat([mean[:, 0], (rk - mean).reshape(batch_size, -1, rk.shape[-1])], 1)
    return new_left, new_right


def fold(grad: PerExampleGrad, batch_size: int) -> PerExampleGrad:
    """Fold ``N = k * batch_size`` row-gradients into per-example ones, rows ``i*k .. i*k+k-1`` being example ``i``.

    A flattened layout (OPT's ``[B*T, d]``, several images per example) gives a rule ``k`` rows per example; the
    gradient of example ``i`` is the sum over its rows, which for a factored gradient is a concatenation of the
    rows' positions: ``sum_r sum_t L_{r,t} R_{r,t}^T``.
    """
    if isinstance(grad, InstantiatedGrad):
        n = grad.value.shape[0]
        if n == batch_size:
            return grad
        return InstantiatedGrad(grad.value.reshape(batch_size, n // batch_size, *grad.value.shape[1:]).sum(1))
    rows = grad.left.batch_size if isinstance(grad.left, IndexFactor) else grad.left.shape[0]
    if rows == batch_size:
        return grad
    if isinstance(grad.left, Tensor) and isinstance(grad.right, Tensor):
        return FactoredGrad(*_fold_centred(grad.left, grad.right, batch_size), grad.shape)
    return FactoredGrad(_fold_factor(grad.left, batch_size), _fold_factor(grad.right, batch_size), grad.shape)


def _kind(f: Factor) -> tuple:
    return ("index", f.size) if isinstance(f, IndexFactor) else ("dense", f.shape[-1])


def _cat(factors: list[Factor]) -> Factor:
    if isinstance(factors[0], IndexFactor):
        return IndexFactor(torch.cat([f.index for f in factors], 1), factors[0].size)
    dtype = factors[0].dtype
    for f in factors[1:]:
        dtype = promote(dtype, f.dtype)
    return torch.cat([f.to(dtype) for f in factors], 1)


def merge(grads: list[PerExampleGrad]) -> list[PerExampleGrad]:
    """Combine the per-use gradients of one parameter into as few pieces as possible, exactly.

    Instantiated pieces are added; factored pieces with factors of the same kinds are concatenated along the
    positions (``sum_k sum_t L^k_t R^k_t^T`` is one factored gradient over all positions). What remains (e.g. a
    one-hot embedding factor and a dense ``lm_head`` factor) needs the cross terms of :func:`inner`.
    """
    dense: InstantiatedGrad | None = None
    groups: dict[tuple, list[FactoredGrad]] = {}
    for g in grads:
        if isinstance(g, InstantiatedGrad):
            dense = g if dense is None else InstantiatedGrad(dense.value + g.value)
        else:
            groups.setdefault((_kind(g.left), _kind(g.right)), []).append(g)
    out: list[PerExampleGrad] = [] if dense is None else [dense]
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
        else:
            out.append(FactoredGrad(_cat([g.left for g in group]), _cat([g.right for g in group]), group[0].shape))
    return out


@dataclass(frozen=True)
class Units:
    """Which privacy unit (e.g. one user) each example of a batch belongs to, for clipping per unit.

    ``index[i]`` is the unit of example ``i`` (codes ``0 .. count - 1``, each used), ``slot[i]`` its position among
    the examples of its unit, ``width`` the most examples of one unit.
    """

    index: Tensor  # [B] long
    slot: Tensor  # [B] long
    count: int
    width: int
    trivial: bool = False  # one example per unit, in order: grouping changes nothing (found on the host)

    @classmethod
    def of(cls, codes, device: torch.device | str | None = None) -> Units:
        """From the unit code of every example (a host sequence or CPU tensor: read on the host, no device sync).

        Raises:
            ValueError: codes that are not integers ``0 .. U - 1`` with every unit present.
        """
        codes = torch.as_tensor(codes).cpu()
        if codes.dim() != 1 or (codes.numel() and (codes.dtype.is_floating_point or codes.dtype == torch.bool)):
            raise ValueError(f"unit codes must be a 1-D integer sequence, got shape {tuple(codes.shape)}")
        codes = codes.long()
        count = int(codes.max()) + 1 if codes.numel() else 0
        sizes = torch.bincount(codes, minlength=count) if codes.numel() else codes.new_zeros(0)
        if codes.numel() and (int(codes.min()) < 0 or bool((sizes == 0).any())):
            raise ValueError(
                f"unit codes must be 0 .. U-1 with every unit present (one code per privacy unit of the batch), "
                f"got {sorted(set(codes.tolist()))[:10]}"
            )
        order = torch.argsort(codes, stable=True)
        starts = torch.cumsum(sizes, 0) - sizes
        slot = torch.empty_like(codes)
        slot[order] = torch.arange(codes.numel()) - starts[codes[order]]
        width = int(sizes.max()) if count else 0
        trivial = width <= 1 and bool((codes == torch.arange(codes.numel())).all())
        return cls(codes.to(device), slot.to(device), count, width, trivial)


def _group_factor(f: Factor, units: Units) -> Factor:
    """Rows of a unit's examples side by side: ``[U, width * T, n]`` (missing examples are rows that add nothing)."""
    if isinstance(f, IndexFactor):
        out = f.index.new_full((units.count, units.width, f.index.shape[1]), -1)
        out[units.index, units.slot] = f.index
        return IndexFactor(out.reshape(units.count, -1), f.size)
    out = f.new_zeros(units.count, units.width, *f.shape[1:])
    out[units.index, units.slot] = f
    return out.reshape(units.count, -1, f.shape[-1])


def group_units(grad: PerExampleGrad, units: Units) -> PerExampleGrad:
    """The gradient of each unit, ``sum_{i in u} G_i``: instantiated ones added, factored ones with the positions of
    the unit's examples concatenated (so the ghost norm of a unit is the Gram over all its rows, cross terms
    between its examples included)."""
    if isinstance(grad, InstantiatedGrad):
        v = grad.value
        return InstantiatedGrad(v.new_zeros(units.count, *v.shape[1:]).index_add_(0, units.index, v))
    return FactoredGrad(_group_factor(grad.left, units), _group_factor(grad.right, units), grad.shape)
