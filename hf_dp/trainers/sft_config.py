"""``DPSFTConfig``: TRL's ``SFTConfig`` with the DP fields, and the SFT settings DP training refuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import _DP_PARAMETERS_DOC, DPArgumentsMixin
from ..losses import LOSS_TYPES
from .trl_common import SFTConfig

__all__ = ["DPSFTConfig", "check_sft_fields"]

#: TRL SFT loss types hf_dp computes per example (each is a per-token loss; TRL's batch-level token mean is replaced
#: by the example's own reduction, ``per_example_loss_reduction``).
SFT_LOSS_TYPES = ("nll", "dft")
#: Packing strategies that put several sequences into one padding-free row (refused: clipped as one example).
PADDING_FREE_PACKING = ("bfd", "bfd_split")


def check_sft_fields(args) -> None:
    """The SFTConfig settings DP training refuses, each with what to set instead."""
    if args.loss_type in LOSS_TYPES or args.loss_type == "auto":
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is an hf_dp per-example loss name, but in DPSFTConfig `loss_type` is "
            f"TRL's field ({list(SFT_LOSS_TYPES)}). Set hf_dp's per-example loss with `dp_loss_type` (SFT always uses "
            "'causal_lm')."
        )
    if args.loss_type not in SFT_LOSS_TYPES:
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is not supported by DPSFTTrainer: hf_dp computes one loss per example, "
            f"and does so for TRL's {list(SFT_LOSS_TYPES)} (per-token losses reduced over each example's own tokens)."
        )
    if args.dp_loss_type != "causal_lm":
        raise ValueError(
            f"`dp_loss_type={args.dp_loss_type!r}`: supervised fine-tuning trains a causal LM, whose per-example loss "
            "is the next-token loss (`dp_loss_type='causal_lm'`, the default of DPSFTConfig)."
        )
    if args.packing and args.packing_strategy in PADDING_FREE_PACKING:
        raise ValueError(
            f"`packing=True` with `packing_strategy={args.packing_strategy!r}` packs several sequences into one "
            "padding-free row (TRL turns `padding_free` on for it), which DP training would clip as one example while "
            "the accountant counts each sequence. Set `packing_strategy='wrapped'` (each packed row of `max_length` "
            "tokens is then one example: the privacy unit is a packed row), or `packing=False`."
        )
    if args.packing and args.privacy_unit == "user":
        raise ValueError(
            "`packing=True` with `privacy_unit='user'`: packing concatenates the rows of different users into one "
            "packed row (and drops the user column), so no row would belong to one user. Set `packing=False` "
            "for user-level DP (each row then stays one user's)."
        )
    if args.padding_free:
        raise ValueError(
            "`padding_free=True` concatenates the micro-batch into one row, which DP training would clip as one "
            "example. Set `padding_free=False` (the per-example clipping needs one row per example)."
        )
    if args.activation_offloading:
        raise ValueError(
            "`activation_offloading=True` is not supported by DPSFTTrainer yet: TRL's offloading moves the tensors "
            "autograd saves to the CPU, and hf_dp has not checked its book-keeping (and its self-check) against it "
            "(it needs a GPU). Set `activation_offloading=False`; gradient checkpointing is supported."
        )
    if args.loss_type == "dft" and args.label_smoothing_factor > 0:
        raise ValueError(
            "`loss_type='dft'` with `label_smoothing_factor > 0`: TRL's DFT loss has no label smoothing (it would be "
            "ignored). Set `label_smoothing_factor=0`, or use `loss_type='nll'`."
        )


@dataclass
class DPSFTConfig(DPArgumentsMixin, SFTConfig):
    __doc__ = (
        "Configuration for [`DPSFTTrainer`]: every field of TRL's [`~trl.SFTConfig`] (with TRL's defaults and "
        "meanings, `loss_type` included: `'nll'` or `'dft'`), plus the DP fields below.\n\n"
        "    Refused, with what to set instead: `packing=True` with the padding-free strategies `'bfd'`/`'bfd_split'` "
        "(use `packing_strategy='wrapped'`: each packed row is then the privacy unit), `padding_free=True`, "
        "`activation_offloading=True`, `packing=True` with `privacy_unit='user'` (packed rows mix users), and TRL "
        "loss types other than `'nll'` and `'dft'`.\n\n"
        "    hf_dp's per-example loss is `dp_loss_type` (always `'causal_lm'` for SFT); TRL's `loss_type` keeps its "
        f"meaning.\n\n    Parameters:{_DP_PARAMETERS_DOC}"
    )

    dp_loss_type: str = field(
        default="causal_lm",
        metadata={"help": "hf_dp's per-example loss: SFT trains a causal LM ('causal_lm')."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_sft_fields(self)
