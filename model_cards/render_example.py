"""Re-render ``example_rendered_demo_card.md`` (and its epsilon plot) from the packaged template.

The values are those of the offline demo (``make demo``: N = 4000, L = 200, C = 0.5, 160 noisy steps, sigma
calibrated to epsilon 8 under RDP); the epsilons are recomputed with ``hf_dp.accounting``. Run it after changing the
template; ``tests/release/test_model_card.py`` checks that the checked-in rendering is up to date.

    python model_cards/render_example.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hf_dp.accounting import epsilon
from hf_dp.release.epsilon_plot import plot_epsilon_curve
from hf_dp.release.model_card import DPModelCardData, render_dp_section, write_dp_model_card

HERE = Path(__file__).resolve().parent
CARD = HERE / "example_rendered_demo_card.md"
PLOT = "example_epsilon.png"
NOTE = (
    "> **Example rendering** of the model card that `make demo` writes (values from the demo's settings), produced by "
    "`python model_cards/render_example.py` from `hf_dp/release/templates/dp_model_card.md`."
)

SIGMA, Q, STEPS, N, DELTA = 0.7415, 0.05, 160, 4000, 1.25e-4
ACCOUNTANTS = ("rdp", "prv", "gdp")


def example_data() -> DPModelCardData:
    """The demo's card data, with every accountant's epsilon recomputed."""
    return DPModelCardData(
        epsilons={a: epsilon(SIGMA, sample_rate=Q, steps=STEPS, delta=DELTA, accountant=a) for a in ACCOUNTANTS},
        accountant="rdp",
        delta=DELTA,
        expected_batch_size=round(Q * N),
        num_examples=N,
        max_grad_norm=0.5,
        clipping_mode="bk-mixopt",
        poisson_sampling=True,
        optimizer="AdamW",
        segments=[(SIGMA, Q, STEPS)],
        epsilon_plot=PLOT,
    )


def render_example() -> str:
    """The text of ``example_rendered_demo_card.md``: the note, then the README.md the demo would write."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "demo_output")
        os.makedirs(folder)
        write_dp_model_card(folder, render_dp_section(example_data()))
        return NOTE + "\n\n" + Path(folder, "README.md").read_text(encoding="utf-8")


def epsilon_points() -> list[tuple[int, float]]:
    """The RDP epsilon every 10 steps, as the trainer logs it."""
    return [(t, epsilon(SIGMA, sample_rate=Q, steps=t, delta=DELTA, accountant="rdp")) for t in range(0, STEPS + 1, 10)]


def main() -> None:
    CARD.write_text(render_example(), encoding="utf-8")
    if not plot_epsilon_curve(epsilon_points(), str(HERE / PLOT), accountant="rdp"):
        print(f"matplotlib is not installed: {PLOT} was not redrawn (pip install matplotlib).")
    print(f"wrote {CARD}")


if __name__ == "__main__":
    main()
