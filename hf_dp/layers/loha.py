"""peft LoHa on ``nn.Linear``: ``dW = s (A1 B1) * (A2 B2)`` (Hadamard product; ``A`` ``out x r``, ``B`` ``r x in``).

With ``H_i = sum_t u_t x_t^T`` (:mod:`.lycoris`: ``u_t = s d * g_t``), ``dL_i/d(A1 B1) = H_i * (A2 B2)``, and
``H * (A2 B2) = sum_{t,k} (u_t * A2[:, k]) (x_t * B2[k, :])^T``, so, without forming ``H_i``:

``dL_i/dA1[o, j] = sum_k A2[o, k] sum_t u_t[o] <x_t, B2[k] * B1[j]>`` and
``dL_i/dB1[j, :] = sum_k B2[k] * sum_t <u_t, A2[:, k] * A1[:, j]> x_t``,

``O(T r^2 (in + out))`` per example; ``A2, B2`` the same with the roles of the two pairs swapped. The module's draws
(module and rank dropout) are read by :class:`~.lycoris.LycorisLinearRule`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .lycoris import LycorisLinearRule
from .registry import register_rule

try:
    from peft.tuners.loha.layer import Linear as LoHaLinear
except ImportError:  # peft is a dependency, but keep the registry importable without it
    LoHaLinear = None


def _left_grad(u: Tensor, x: Tensor, b: Tensor, a_other: Tensor, b_other: Tensor) -> Tensor:
    """``[N, out, r]``: ``sum_{t,k} u_t[o] a_other[o, k] <x_t, b_other[k] * b[j]>``."""
    n, r_other, r = u.shape[0], b_other.shape[0], b.shape[0]
    pairs = (b_other[:, None, :] * b[None, :, :]).reshape(r_other * r, -1)  # [k * r + j] = b_other[k] * b[j]
    q = u.transpose(1, 2) @ (x @ pairs.T)  # [N, out, r_other * r]
    return torch.einsum("nokj,ok->noj", q.view(n, -1, r_other, r), a_other)


def _right_grad(u: Tensor, x: Tensor, a: Tensor, a_other: Tensor, b_other: Tensor) -> Tensor:
    """``[N, r, in]``: ``sum_{t,k} <u_t, a_other[:, k] * a[:, j]> x_t * b_other[k]``."""
    n, r_other, r = u.shape[0], a_other.shape[1], a.shape[1]
    pairs = (a_other[:, :, None] * a[:, None, :]).reshape(a.shape[0], r_other * r)  # [:, k * r + j]
    rows = (u @ pairs).transpose(1, 2) @ x  # [N, r_other * r, in]
    return torch.einsum("nkji,ki->nji", rows.view(n, r_other, r, -1), b_other)


if LoHaLinear is not None:

    @register_rule(LoHaLinear)
    class LoHaLinearRule(LycorisLinearRule):
        factor_names = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
        unsupported = ("hada_t1", "hada_t2")

        def rank_factors(self, keep: Tensor, scale: bool, dtype: torch.dtype) -> Tensor:
            drop = keep.to(dtype)  # peft: `drop = (rand > p).to(weight.dtype); drop /= drop.mean()`
            return drop / drop.mean()

        def adapter_grads(
            self, module: nn.Module, adapter: str, x: Tensor, u: Tensor, trainable: set[nn.Parameter]
        ) -> dict[nn.Parameter, Tensor]:
            params = [getattr(module, name)[adapter] for name in self.factor_names]
            a1, b1, a2, b2 = (p.detach().to(x.dtype) for p in params)
            grads: dict[nn.Parameter, Tensor] = {}
            for (pa, pb), (a, b, a_other, b_other) in (
                ((params[0], params[1]), (a1, b1, a2, b2)),
                ((params[2], params[3]), (a2, b2, a1, b1)),
            ):
                if pa in trainable:
                    grads[pa] = _left_grad(u, x, b, a_other, b_other)
                if pb in trainable:
                    grads[pb] = _right_grad(u, x, a, a_other, b_other)
            return grads
