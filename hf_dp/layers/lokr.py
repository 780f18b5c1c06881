"""peft LoKr on ``nn.Linear``: ``dW = s kron(W1, W2)``, ``W1`` ``a x c`` (or ``w1_a @ w1_b``), ``W2`` ``b x e`` (or
``w2_a @ w2_b``), ``out = a b``, ``in = c e``.

``kron(W1, W2)[i b + k, j e + l] = W1[i, j] W2[k, l]``, so with ``x_t`` read as ``X_t`` (``c x e``, row-major) and
``u_t`` (:mod:`.lycoris`: ``u_t = s d * g_t``) as ``U_t`` (``a x b``), the call adds ``Y_t = W1 X_t W2^T`` and

``dL_i/dW1 = sum_t U_t W2 X_t^T`` (``a x c``), ``dL_i/dW2 = sum_t U_t^T W1 X_t`` (``b x e``);

for factored ``W = A B``: ``dL/dA = dL/dW B^T``, ``dL/dB = A^T dL/dW``. Small per example (about ``sqrt(out) x
sqrt(in)``): instantiated. The module's draws (module and rank dropout) are read by
:class:`~.lycoris.LycorisLinearRule`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .lycoris import LycorisLinearRule
from .registry import register_rule

try:
    from peft.tuners.lokr.layer import Linear as LoKrLinear
except ImportError:  # peft is a dependency, but keep the registry importable without it
    LoKrLinear = None


def _factor(module: nn.Module, adapter: str, which: str, dtype: torch.dtype) -> tuple:
    """``(W, whole parameter or None, (A, B) parameters or None)`` of factor ``which`` ("w1" or "w2")."""
    whole = getattr(module, f"lokr_{which}")
    if adapter in whole:
        p = whole[adapter]
        return p.detach().to(dtype), p, None
    a, b = getattr(module, f"lokr_{which}_a")[adapter], getattr(module, f"lokr_{which}_b")[adapter]
    return a.detach().to(dtype) @ b.detach().to(dtype), None, (a, b)


def _chain(grads: dict, d_w: Tensor, whole, pair, trainable: set, dtype: torch.dtype) -> None:
    """The gradients of a factor's parameters from ``d_w`` ``[N, *W.shape]``."""
    if whole is not None:
        grads[whole] = d_w
        return
    a, b = pair
    if a in trainable:
        grads[a] = d_w @ b.detach().to(dtype).T
    if b in trainable:
        grads[b] = a.detach().to(dtype).T @ d_w


if LoKrLinear is not None:

    @register_rule(LoKrLinear)
    class LoKrLinearRule(LycorisLinearRule):
        factor_names = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
        unsupported = ("lokr_t2",)

        @staticmethod
        def _rank_scale(module: nn.Module, adapter: str) -> bool:
            return bool(module.rank_dropout_scale[adapter])

        def rank_factors(self, keep: Tensor, scale: bool, dtype: torch.dtype) -> Tensor:
            drop = keep.float()  # peft: `drop = (rand > p).float()`, `drop /= drop.mean()` if rank_dropout_scale
            return drop / drop.mean() if scale else drop

        def adapter_grads(
            self, module: nn.Module, adapter: str, x: Tensor, u: Tensor, trainable: set[nn.Parameter]
        ) -> dict[nn.Parameter, Tensor]:
            w1, whole1, pair1 = _factor(module, adapter, "w1", x.dtype)
            w2, whole2, pair2 = _factor(module, adapter, "w2", x.dtype)
            n, t = x.shape[:2]
            big_u = u.reshape(n, t, w1.shape[0], w2.shape[0])  # U_t: a x b
            big_x = x.reshape(n, t, w1.shape[1], w2.shape[1])  # X_t: c x e
            grads: dict[nn.Parameter, Tensor] = {}
            if any(p in trainable for p in (whole1, *(pair1 or ()))):
                d_w1 = torch.einsum("ntae,ntce->nac", big_u @ w2, big_x)
                _chain(grads, d_w1, whole1, pair1, trainable, x.dtype)
            if any(p in trainable for p in (whole2, *(pair2 or ()))):
                d_w2 = torch.einsum("ntab,ntae->nbe", big_u, w1 @ big_x)
                _chain(grads, d_w2, whole2, pair2, trainable, x.dtype)
            return grads
