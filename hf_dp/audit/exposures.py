"""Exposure of generative canaries (Carlini, Liu, Erlingsson, Kos and Song 2019, "The Secret Sharer", Sec. 4).

Rank the canary's secret by its loss among candidates from the same space (the secret itself plus ``n`` random
alternatives with the same prefix/key): ``exposure = log2(n + 1) - log2(rank)``, rank 1 being the lowest loss. A
secret the model never saw ranks uniformly at random, so its expected exposure is about ``log2(e) = 1.44``; the
maximum is ``log2(n + 1)``, reached when the secret beats every alternative. With sampled alternatives this is the
paper's sampling estimate of the rank among the whole space (their Sec. 4.2 extrapolates beyond it; we do not).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from torch import nn

from .canaries import _ALTERNATIVE_STREAM, CanarySet, canary_rng
from .losses import canary_losses

__all__ = ["canary_exposures", "exposure"]


def exposure(secret_loss: float, alternative_losses: Sequence[float]) -> float:
    """``log2(n + 1) - log2(rank)`` of the secret among itself and ``n`` alternatives.

    Ties count against the secret (an alternative with the same loss ranks ahead), so exposure is never overstated.

    Args:
        secret_loss (`float`): the secret's loss under the model.
        alternative_losses (`Sequence[float]`): the losses of ``n >= 1`` random alternatives.

    Returns:
        `float`: exposure in bits, in ``[0, log2(n + 1)]``.

    Example:
        ```python
        >>> exposure(0.5, [1.0, 2.0, 3.0])  # the lowest of 4 candidates: log2(4) - log2(1)
        2.0
        ```
    """
    alternatives = np.asarray(alternative_losses, dtype=np.float64)
    if alternatives.ndim != 1 or len(alternatives) == 0:
        raise ValueError("`alternative_losses` must be a non-empty 1-D sequence of losses.")
    if not (np.isfinite(alternatives).all() and math.isfinite(secret_loss)):
        raise ValueError("Exposure needs finite losses; the model's loss overflowed or is NaN.")
    rank = 1 + int((alternatives <= secret_loss).sum())
    return math.log2(len(alternatives) + 1) - math.log2(rank)


def canary_exposures(
    model: nn.Module,
    canaries: CanarySet,
    *,
    num_alternatives: int = 100,
    secret_losses: Sequence[float] | None = None,
    seed: int | None = None,
    batch_size: int = 64,
) -> np.ndarray:
    """Exposure of every canary under ``model``.

    Canaries of one group (the same prefix, e.g. one template) share their ``num_alternatives`` alternatives, so a
    shared-prefix causal-LM set costs ``num_alternatives`` extra forward passes in all; masked-LM canaries (one key
    each) cost that many per canary.

    Args:
        model (`nn.Module`): the trained model.
        canaries (`CanarySet`): generative canaries (causal or masked LM).
        num_alternatives (`int`, *optional*, defaults to 100): random alternatives per group (n).
        secret_losses (`Sequence[float]`, *optional*): the canaries' own losses under ``model`` if already computed.
        seed (`int`, *optional*): seed of the alternatives (None: OS entropy).
        batch_size (`int`, *optional*, defaults to 64): items per forward pass.

    Returns:
        `np.ndarray`: one exposure per canary, in bits.

    Raises:
        TypeError: if the canaries have no secret (classification canaries).
    """
    if not canaries.generative:
        raise TypeError(
            f"Exposure needs generative canaries (a secret to rank), got {type(canaries).__name__}; leave "
            "`num_alternatives=0` for classification canaries."
        )
    if num_alternatives < 1:
        raise ValueError(f"`num_alternatives` must be >= 1, got {num_alternatives}.")
    m = len(canaries)
    kwargs = dict(task=canaries.task, pad_token_id=canaries.pad_token_id, batch_size=batch_size)
    if secret_losses is None:
        secret_losses = canary_losses(model, [canaries[i] for i in range(m)], **kwargs)
    secret_losses = np.asarray(secret_losses, dtype=np.float64)
    rng = canary_rng(seed, _ALTERNATIVE_STREAM)
    groups: dict[int, list[int]] = {}
    for i in range(m):
        groups.setdefault(canaries.group(i), []).append(i)
    out = np.empty(m)
    for members in groups.values():
        first = members[0]
        secrets = canaries.random_secrets(num_alternatives, rng)
        alternatives = canary_losses(model, [canaries.with_secret(first, s) for s in secrets], **kwargs)
        for i in members:
            out[i] = exposure(float(secret_losses[i]), alternatives)
    return out
