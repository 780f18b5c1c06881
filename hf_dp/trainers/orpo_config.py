"""``DPORPOConfig``: TRL's ``ORPOConfig`` (``trl.experimental.orpo``) with the DP fields, and the ORPO settings DP
training refuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import _DP_PARAMETERS_DOC, DPArgumentsMixin
from .pair_policy import ORPOConfig, check_pair_policy_fields

__all__ = ["DPORPOConfig", "check_orpo_fields"]


def check_orpo_fields(args) -> None:
    """The ORPOConfig settings DP training refuses, each with what to set instead."""
    check_pair_policy_fields(args, "DPORPOTrainer")


@dataclass
class DPORPOConfig(DPArgumentsMixin, ORPOConfig):
    __doc__ = (
        "Configuration for [`DPORPOTrainer`]: every field of TRL's [`~trl.experimental.orpo.ORPOConfig`] (with TRL's "
        "defaults and meanings, `beta` included), plus the DP fields below.\n\n"
        "    The per-example loss is each preference pair's ORPO loss: the negative log-likelihood of its chosen "
        "sequence (prompt and completion, as TRL), averaged over that pair's own tokens "
        "(`per_example_loss_reduction='mean'`; TRL averages over the tokens of the whole batch) or summed, minus "
        "`beta * log sigmoid(log odds ratio)` of its average completion log-probabilities. `remove_unused_columns` "
        "defaults to `False` (TRL's paired collator reads columns the model does not take; TRL would set it). "
        "Refused, with what to set instead: encoder-decoder models, FSDP.\n\n"
        f"    Parameters:{_DP_PARAMETERS_DOC}"
    )

    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Keep `False`: TRL's paired collator reads the `chosen_*`/`rejected_*` columns."},
    )
    dp_loss_type: str = field(
        default="causal_lm",
        metadata={"help": "Not used by ORPO (the per-example loss is the ORPO loss of each pair); keep 'causal_lm'."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_orpo_fields(self)
