"""``DPSFTConfig``: TRL's ``SFTConfig`` with the DP fields, and the SFT settings DP training refuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import _DP_PARAMETERS_DOC, DPArgumentsMixin
from ..losses import LOSS_TYPES
from .trl_common import SFTConfig

__all__ = ["DPSFTConfig", "check_sft_fields", "packs_sequences"]

#: TRL SFT loss types hf_dp computes per example (each is a per-token loss; TRL's batch-level token mean is replaced
#: by the example's own reduction, ``per_example_loss_reduction``).
SFT_LOSS_TYPES = ("nll", "dft")


def packs_sequences(args) -> bool:
    """Whether the run packs sequences padding-free (TRL's ``packing_strategy="bfd"``, or ``padding_free=True``):
    hf_dp then samples sequences and clips each sequence of a packed row as one example."""
    return bool(args.padding_free or (args.packing and args.packing_strategy == "bfd"))


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
    _check_packing(args)
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


def _check_packing(args) -> None:
    """The packing settings DP training refuses: ``bfd_split`` (one document's pieces would be separate examples),
    user-level DP with packing, and padding (position 0 on a pad would start a sequence)."""
    if args.packing and args.packing_strategy == "bfd_split":
        raise ValueError(
            "`packing_strategy='bfd_split'` splits a sequence longer than `max_length` into pieces, each packed as a "
            "sequence of its own (positions restarting at 0), which DP training would clip as separate examples "
            "although they are one example of the training set. Set `packing_strategy='bfd'` (TRL's default: such "
            "a sequence is truncated to `max_length`), or `packing_strategy='wrapped'` (each packed row of "
            "`max_length` tokens is then the privacy unit)."
        )
    if args.packing and args.packing_strategy == "wrapped" and args.padding_free:
        raise ValueError(
            "`padding_free=True` with `packing_strategy='wrapped'`: the privacy unit would be neither a packed row "
            "nor a sequence. Set `padding_free=False` (the unit is a packed row of `max_length` tokens), or "
            "`packing_strategy='bfd'` (the unit is a sequence, each clipped on its own)."
        )
    if (args.packing or args.padding_free) and args.privacy_unit == "user":
        raise ValueError(
            "`packing=True` (or `padding_free=True`) with `privacy_unit='user'`: packing concatenates the rows of "
            "different users into one packed row (and drops the user column), so no row would belong to one user. "
            "Set `packing=False` and `padding_free=False` for user-level DP (each row then stays one user's)."
        )
    if packs_sequences(args) and args.pad_to_multiple_of is not None:
        raise ValueError(
            f"`pad_to_multiple_of={args.pad_to_multiple_of}` with padding-free packing: TRL pads the packed row with "
            "tokens at position 0, each of which would start a sequence (an example) of its own. Set "
            "`pad_to_multiple_of=None`."
        )


@dataclass
class DPSFTConfig(DPArgumentsMixin, SFTConfig):
    __doc__ = (
        "Configuration for [`DPSFTTrainer`]: every field of TRL's [`~trl.SFTConfig`] (with TRL's defaults and "
        "meanings, `loss_type` included: `'nll'` or `'dft'`), plus the DP fields below.\n\n"
        "    Packing: with `packing=True` and TRL's default `packing_strategy='bfd'` (or `padding_free=True`) the "
        "privacy unit is a sequence, one example of the training set: hf_dp Poisson-samples sequences (q and the "
        "expected batch size count sequences: `per_device_train_batch_size` is the expected number of sequences per "
        "micro-batch), packs each micro-batch's sequences into one padding-free row as TRL does, and clips each "
        "sequence on its own. With `packing_strategy='wrapped'` the unit is a packed row of `max_length` tokens.\n\n"
        "    Refused, with what to set instead: `packing_strategy='bfd_split'` (a document's pieces would be clipped "
        "as separate examples), `pad_to_multiple_of` with padding-free packing, `activation_offloading=True`, "
        "`packing=True` or `padding_free=True` with `privacy_unit='user'` (packed rows mix users), and TRL loss types "
        "other than `'nll'` and `'dft'`.\n\n"
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
