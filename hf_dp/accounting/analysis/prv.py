"""Privacy random variables (Gopi, Lee & Wutschitz 2021), through the ``prv-accountant`` package.

We report its UPPER bound on epsilon. Building the discretised composition is the slow part, so one accountant is
built per history of ``(noise_multiplier, sample_rate)`` segments and ``max_self_compositions`` (rounded up to a
power of two, so asking for more steps rebuilds rarely) and cached; asking for fewer steps reuses it.

Error budget: ``delta_error = 1e-3 * delta`` and ``eps_error = 0.01 * sqrt(max_steps / 1024)``, between 0.01 and 0.1.
The mesh has ``~ sqrt(steps) / eps_error`` points, so this keeps one evaluation at about the same cost for any number
of steps (under 2 s on 2 CPU cores up to 100,000 steps), while epsilon itself grows about like ``sqrt(steps)``: the
upper bound stays within ~1% of the estimate in the usual regimes (0.01 absolute up to 1,024 steps). For small
noise multipliers prv-accountant can reject a fine mesh ("Discrete mean differs from continuous mean"); the error
budget is then doubled until it accepts one (at most 0.5), which widens the bounds but keeps them valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["prv_epsilon_bounds", "prv_errors"]

#: Smallest and largest absolute error allowed in epsilon (see the module docstring).
PRV_EPS_ERROR_MIN, PRV_EPS_ERROR_MAX = 0.01, 0.1
#: Coarsest eps_error tried when prv-accountant rejects a finer mesh.
PRV_EPS_ERROR_COARSEST = 0.5
#: delta_error = PRV_DELTA_ERROR_FRACTION * delta.
PRV_DELTA_ERROR_FRACTION = 1e-3


def _round_up(steps: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, steps))))


def prv_errors(max_steps: int, delta: float) -> tuple[float, float]:
    """``(eps_error, delta_error)`` used for a composition of at most ``max_steps`` steps."""
    eps_error = min(PRV_EPS_ERROR_MAX, max(PRV_EPS_ERROR_MIN, PRV_EPS_ERROR_MIN * math.sqrt(max_steps / 1024)))
    return eps_error, PRV_DELTA_ERROR_FRACTION * delta


@lru_cache(maxsize=64)
def _accountant(
    mechanisms: tuple[tuple[float, float], ...], max_steps: tuple[int, ...], eps_error: float, delta_error: float
):
    try:
        from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism, PRVAccountant
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise ImportError("The PRV accountant needs `prv-accountant`: pip install prv-accountant") from err
    prvs = [
        GaussianMechanism(noise_multiplier=sigma)
        if q == 1.0
        else PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)
        for sigma, q in mechanisms
    ]
    return PRVAccountant(prvs=prvs, max_self_compositions=list(max_steps), eps_error=eps_error, delta_error=delta_error)


def prv_epsilon_bounds(segments: Sequence[tuple[float, float, int]], delta: float) -> tuple[float, float, float]:
    """``(lower, estimate, upper)`` epsilon of the composition of ``(sigma, q, steps)`` segments."""
    merged: dict[tuple[float, float], int] = {}
    for sigma, q, steps in segments:
        if steps > 0 and q > 0:
            if sigma == 0:
                return math.inf, math.inf, math.inf
            merged[(float(sigma), float(q))] = merged.get((float(sigma), float(q)), 0) + int(steps)
    if not merged:
        return 0.0, 0.0, 0.0
    mechanisms = tuple(sorted(merged))
    steps = [merged[m] for m in mechanisms]
    max_steps = tuple(_round_up(s) for s in steps)
    eps_error, delta_error = prv_errors(sum(max_steps), delta)
    while True:
        try:
            accountant = _accountant(mechanisms, max_steps, eps_error, delta_error)
            lower, estimate, upper = accountant.compute_epsilon(delta=delta, num_self_compositions=steps)
            return float(lower), float(estimate), float(upper)
        except RuntimeError as err:
            # prv-accountant rejects a mesh on which the discretised mean drifts (small sigma, fine mesh): coarsen
            # it; the bounds stay rigorous, only wider by the larger eps_error.
            if eps_error >= PRV_EPS_ERROR_COARSEST:
                raise ValueError(
                    f"The PRV accountant cannot discretise sigma={mechanisms}, steps={steps} ({err}). Use the "
                    "'rdp' accountant for this setting."
                ) from err
            eps_error = min(PRV_EPS_ERROR_COARSEST, eps_error * 2)
