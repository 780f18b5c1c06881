"""``DPCPOConfig``: TRL's ``CPOConfig`` (``trl.experimental.cpo``) with the DP fields, and the CPO settings DP training
refuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import _DP_PARAMETERS_DOC, DPArgumentsMixin
from ..losses import LOSS_TYPES
from .pair_policy import CPOConfig, check_pair_policy_fields

__all__ = ["CPO_LOSS_TYPES", "DPCPOConfig", "check_cpo_fields"]

#: TRL CPO loss types, each computed per preference pair (`"alphapo"` is TRL's name for `"simpo"` with `alpha` and no
#: BC term: CPOConfig turns it into these settings).
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
#: Loss types that read ``label_smoothing``.
_SMOOTHED = ("sigmoid", "simpo")


def check_cpo_fields(args) -> None:
    """The CPOConfig settings DP training refuses, each with what to set instead."""
    if args.loss_type in LOSS_TYPES or args.loss_type == "auto":
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is an hf_dp per-example loss name, but in DPCPOConfig `loss_type` is "
            f"TRL's field (the CPO losses, {list(CPO_LOSS_TYPES)}). hf_dp's per-example loss is `dp_loss_type`, which "
            "CPO does not use (the per-example loss is the CPO loss of each preference pair)."
        )
    if args.loss_type not in CPO_LOSS_TYPES:
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is not supported by DPCPOTrainer: hf_dp computes one loss per preference "
            f"pair, and does so for TRL's {list(CPO_LOSS_TYPES)} (and 'alphapo')."
        )
    if args.label_smoothing and args.loss_type not in _SMOOTHED:
        raise ValueError(
            f"`label_smoothing={args.label_smoothing}` with `loss_type={args.loss_type!r}`: TRL's {args.loss_type} "
            "loss does not use label smoothing (it would be ignored). Set `label_smoothing=0.0`, or use "
            "`loss_type='sigmoid'` or 'simpo'."
        )
    check_pair_policy_fields(args, "DPCPOTrainer")


@dataclass
class DPCPOConfig(DPArgumentsMixin, CPOConfig):
    __doc__ = (
        "Configuration for [`DPCPOTrainer`]: every field of TRL's [`~trl.experimental.cpo.CPOConfig`] (with TRL's "
        "defaults and meanings: `loss_type`, `beta`, `cpo_alpha`, `simpo_gamma`, `alpha`, `label_smoothing`), plus "
        "the DP fields below.\n\n"
        f"    Supported TRL loss types (each computed per preference pair): {list(CPO_LOSS_TYPES)} and 'alphapo', with "
        "the AlphaPO reward shape (`alpha`) and the BC term (`cpo_alpha` times the negative log-likelihood of the "
        "pair's chosen completion, averaged over that pair's own tokens with `per_example_loss_reduction='mean'`; TRL "
        "averages over the tokens of the whole batch). `remove_unused_columns` defaults to `False` (TRL's paired "
        "collator reads columns the model does not take; TRL would set it). Refused, with what to set instead: "
        "`label_smoothing > 0` with a loss type that ignores it, encoder-decoder models, FSDP.\n\n"
        f"    Parameters:{_DP_PARAMETERS_DOC}"
    )

    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Keep `False`: TRL's paired collator reads the `chosen_*`/`rejected_*` columns."},
    )
    dp_loss_type: str = field(
        default="causal_lm",
        metadata={"help": "Not used by CPO (the per-example loss is the CPO loss of each pair); keep 'causal_lm'."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_cpo_fields(self)
