"""A PNG of epsilon spent against the step, for the model card (optional: needs matplotlib)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)

__all__ = ["plot_epsilon_curve"]

_ACCOUNTANT_LABELS = {"rdp": "RDP", "prv": "PRV upper bound", "gdp": "GDP (CLT) estimate"}


def plot_epsilon_curve(points: Sequence[tuple[int, float]], path: str, *, accountant: str) -> bool:
    """Draw epsilon against the optimizer step and save it as a PNG.

    Epsilon depends only on the noise multiplier, the sample rate and the number of steps, never on the training
    data, so the curve may be published. Matplotlib is optional: without it nothing is written and the function
    returns `False`. The figure is drawn with matplotlib's object API on an Agg canvas, so the global backend of the
    caller (a notebook, say) is left alone.

    Args:
        points (`Sequence[tuple[int, float]]`): `(step, epsilon)` pairs, e.g. one per logging step.
        path (`str`): the PNG to write; its folder is created if needed.
        accountant (`str`): the accountant that computed the epsilons (`"rdp"`, `"prv"` or `"gdp"`), for the label.

    Returns:
        `bool`: `True` if the file was written, `False` if matplotlib is not installed.

    Raises:
        ValueError: if `points` is empty, holds a non-finite or negative epsilon, or `accountant` is unknown.

    Example:
        ```python
        if plot_epsilon_curve([(0, 0.0), (100, 1.7), (200, 2.6)], "out/epsilon.png", accountant="rdp"):
            data.epsilon_plot = "epsilon.png"
        ```
    """
    if accountant not in _ACCOUNTANT_LABELS:
        raise ValueError(f"Unknown accountant {accountant!r}: set `accountant` to one of {sorted(_ACCOUNTANT_LABELS)}.")
    pairs = sorted((int(step), float(eps)) for step, eps in points)
    if not pairs:
        raise ValueError("`points` is empty: pass at least one (step, epsilon) pair to plot.")
    bad = [(step, eps) for step, eps in pairs if not math.isfinite(eps) or eps < 0]
    if bad:
        raise ValueError(
            f"Cannot plot epsilon {bad[0][1]} at step {bad[0][0]}: every epsilon must be finite and >= 0 (an "
            "infinite epsilon means a step without noise; such a run has no guarantee to plot)."
        )
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.info("matplotlib is not installed: no epsilon plot (pip install matplotlib).")
        return False

    fig = Figure(figsize=(5, 3), dpi=100)
    ax = fig.add_subplot()
    ax.plot([s for s, _ in pairs], [e for _, e in pairs], marker="." if len(pairs) < 50 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("epsilon")
    ax.set_title(f"Privacy spent ({_ACCOUNTANT_LABELS[accountant]})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, format="png")
    return True
