"""The "Differential privacy" section of the model card, rendered from the template in ``model_cards/``."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

__all__ = ["DP_TAGS", "DPModelCardData", "render_dp_section", "template_path", "write_dp_model_card"]

DP_TAGS = ["differential-privacy", "hf-dp"]
TEMPLATE_NAME = "dp_model_card.md"


def template_path() -> Path:
    """The template: ``model_cards/`` in a source checkout, or ``<prefix>/share/hf_dp/model_cards`` when installed."""
    candidates = [
        Path(__file__).resolve().parents[1] / "model_cards" / TEMPLATE_NAME,
        Path(sys.prefix) / "share" / "hf_dp" / "model_cards" / TEMPLATE_NAME,
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"DP model card template {TEMPLATE_NAME} not found in {[str(c) for c in candidates]}.")


@dataclass
class DPModelCardData:
    """Everything the DP section states."""

    epsilons: dict[str, float]
    accountant: str
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    expected_batch_size: int
    num_examples: int
    max_grad_norm: float
    clipping_mode: str
    poisson_sampling: bool
    optimizer: str


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def render_dp_section(data: DPModelCardData) -> str:
    from . import __version__

    epsilon = data.epsilons.get(data.accountant, math.inf)
    by_accountant = ", ".join(f"{name}: {_fmt(value)}" for name, value in sorted(data.epsilons.items()))
    if data.poisson_sampling:
        sampling, note = "Poisson (each example included independently with probability q)", ""
    else:
        sampling = "shuffled fixed-size batches (sampling without replacement)"
        note = (
            "\n> [!WARNING]\n> The accountants assume Poisson sampling; with shuffled fixed-size batches the "
            "epsilon above is a heuristic, not a proven bound.\n"
        )
    return Template(template_path().read_text(encoding="utf-8")).substitute(
        hf_dp_version=__version__,
        epsilon=_fmt(epsilon),
        delta=f"{data.delta:.3g}",
        accountant=data.accountant.upper(),
        epsilon_by_accountant=by_accountant,
        noise_multiplier=f"{data.noise_multiplier:.4g}",
        sample_rate=f"{data.sample_rate:.4g}",
        steps=data.steps,
        expected_batch_size=data.expected_batch_size,
        num_examples=data.num_examples,
        max_grad_norm=data.max_grad_norm,
        clipping_mode=data.clipping_mode,
        sampling=sampling,
        optimizer=data.optimizer,
        sampling_note=note,
    )


def write_dp_model_card(output_dir: str, section: str) -> None:
    """Add (or replace) the DP section and tags in ``output_dir/README.md``, creating a minimal card if needed."""
    import os

    from huggingface_hub import ModelCard, ModelCardData

    path = os.path.join(output_dir, "README.md")
    if os.path.exists(path):
        card = ModelCard.load(path)
    else:
        name = os.path.basename(os.path.abspath(output_dir))
        card = ModelCard(f"---\n{ModelCardData().to_yaml()}\n---\n\n# {name}\n\nFine-tuned with hf_dp's DPTrainer.\n")
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *DP_TAGS]))
    text = card.text
    marker = "## Differential privacy"
    if marker in text:
        text = text[: text.index(marker)].rstrip() + "\n"
    card.text = text.rstrip() + "\n\n" + section
    card.save(path)
