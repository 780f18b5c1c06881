"""``DPRewardConfig``: TRL's ``RewardConfig`` with the DP fields, and the reward-modelling settings DP training
refuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import _DP_PARAMETERS_DOC, DPArgumentsMixin
from .trl_common import RewardConfig

__all__ = ["DPRewardConfig", "check_reward_fields"]


def check_reward_fields(args) -> None:
    """The RewardConfig settings DP training refuses, each with what to set instead."""
    if args.dp_loss_type != "causal_lm":
        raise ValueError(
            f"`dp_loss_type={args.dp_loss_type!r}`: DPRewardTrainer's per-example loss is the pairwise loss of each "
            "preference pair (`-log sigmoid(r_chosen - r_rejected)`, TRL's); leave `dp_loss_type` at its default, "
            "'causal_lm'."
        )
    if args.activation_offloading:
        raise ValueError(
            "`activation_offloading=True` is not supported by DPRewardTrainer yet: TRL's offloading moves the tensors "
            "autograd saves to the CPU, and hf_dp has not checked its book-keeping against it. Set "
            "`activation_offloading=False`; gradient checkpointing is supported."
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            "DPRewardTrainer does not support FSDP yet (the paired forward passes have not been checked under "
            "sharding). Train on one process, or with plain data parallelism."
        )


@dataclass
class DPRewardConfig(DPArgumentsMixin, RewardConfig):
    __doc__ = (
        "Configuration for [`DPRewardTrainer`]: every field of TRL's [`~trl.RewardConfig`] (with TRL's defaults and "
        "meanings, `center_rewards_coefficient` included), plus the DP fields below.\n\n"
        "    The per-example loss is each preference pair's own: `-log sigmoid(r_chosen - r_rejected - margin)` (the "
        "`margin` column, if the dataset has one), plus `center_rewards_coefficient * (r_chosen + r_rejected)^2` when "
        "it is set (TRL's batch mean of that term is the mean of these per-pair terms). Refused, with what to set "
        "instead: `activation_offloading=True`, FSDP.\n\n"
        f"    Parameters:{_DP_PARAMETERS_DOC}"
    )

    dp_loss_type: str = field(
        default="causal_lm",
        metadata={"help": "Not used by reward modelling (the per-example loss is the pair's); keep 'causal_lm'."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_reward_fields(self)
