"""``DPDPOConfig``: TRL's ``DPOConfig`` with the DP fields, and the DPO settings DP training refuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import _DP_PARAMETERS_DOC, DPArgumentsMixin
from ..losses import LOSS_TYPES
from .trl_common import DPOConfig

__all__ = ["COUPLED_DPO_LOSS_TYPES", "DPDPOConfig", "DPO_LOSS_TYPES", "check_dpo_fields"]

#: TRL DPO loss types computed per pair (each a function of one pair's policy and reference log-probabilities).
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
)
#: TRL DPO loss types that couple the pairs of a batch (refused).
COUPLED_DPO_LOSS_TYPES = ("aot", "aot_unpaired")
#: Loss types that read ``label_smoothing``.
_SMOOTHED = ("robust", "exo_pair")


def check_dpo_fields(args) -> None:
    """The DPOConfig settings DP training refuses, each with what to set instead."""
    loss_types = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
    for name in loss_types:
        if name in LOSS_TYPES or name == "auto":
            raise ValueError(
                f"`loss_type={name!r}` is an hf_dp per-example loss name, but in DPDPOConfig `loss_type` is TRL's "
                f"field (the DPO losses, e.g. 'sigmoid'). hf_dp's per-example loss is `dp_loss_type`, which DPO does "
                "not use (the per-example loss is the DPO loss of each preference pair)."
            )
        if name in COUPLED_DPO_LOSS_TYPES:
            raise ValueError(
                f"`loss_type={name!r}` sorts the log-ratios over the whole batch (AOT), so each pair's loss depends on "
                "the other pairs of the batch and cannot be clipped per pair. Use a per-pair DPO loss, e.g. "
                f"`loss_type='sigmoid'` (supported: {list(DPO_LOSS_TYPES)})."
            )
        if name not in DPO_LOSS_TYPES:
            raise ValueError(
                f"`loss_type={name!r}` is not supported by DPDPOTrainer: hf_dp computes one loss per preference pair, "
                f"and does so for TRL's {list(DPO_LOSS_TYPES)}."
            )
    if args.dp_loss_type != "causal_lm":
        raise ValueError(
            f"`dp_loss_type={args.dp_loss_type!r}`: DPDPOTrainer's per-example loss is the DPO loss of each preference "
            "pair (TRL's `loss_type`); leave `dp_loss_type` at its default, 'causal_lm'."
        )
    if args.label_smoothing and not any(name in _SMOOTHED for name in loss_types):
        raise ValueError(
            f"`label_smoothing={args.label_smoothing}` with `loss_type={loss_types}`: TRL's DPO losses "
            f"{loss_types} do not use label smoothing (it would be ignored). Set `label_smoothing=0.0`, or use "
            "`loss_type='robust'` (conservative DPO with label smoothing, per pair)."
        )
    if args.use_weighting:
        raise ValueError(
            "`use_weighting=True` (WPO weights) is not supported by DPDPOTrainer yet: set `use_weighting=False`."
        )
    if args.activation_offloading:
        raise ValueError(
            "`activation_offloading=True` is not supported by DPDPOTrainer yet: TRL's offloading moves the tensors "
            "autograd saves to the CPU, and hf_dp has not checked its book-keeping against it. Set "
            "`activation_offloading=False`; gradient checkpointing is supported."
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            "DPDPOTrainer does not support FSDP yet (the reference model and the paired forward passes have not been "
            "checked under sharding). Train on one process, or with plain data parallelism."
        )


@dataclass
class DPDPOConfig(DPArgumentsMixin, DPOConfig):
    __doc__ = (
        "Configuration for [`DPDPOTrainer`]: every field of TRL's [`~trl.DPOConfig`] (with TRL's defaults and "
        "meanings, `loss_type` included), plus the DP fields below.\n\n"
        f"    Supported TRL loss types (each computed per preference pair): {list(DPO_LOSS_TYPES)}, combined with "
        "`loss_weights`; `f_divergence_type` and `ld_alpha` per pair. Refused, with what to set instead: "
        f"{list(COUPLED_DPO_LOSS_TYPES)} (they sort over the batch), `use_weighting=True`, `label_smoothing > 0` "
        "with loss types that ignore it, `activation_offloading=True`, FSDP.\n\n"
        "    `loss_type='sft'` is the negative log-likelihood of each pair's chosen completion, averaged over that "
        "pair's own tokens (TRL averages over the tokens of the whole batch).\n\n"
        f"    Parameters:{_DP_PARAMETERS_DOC}"
    )

    dp_loss_type: str = field(
        default="causal_lm",
        metadata={"help": "Not used by DPO (the per-example loss is the DPO loss of each pair); keep 'causal_lm'."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_dpo_fields(self)
