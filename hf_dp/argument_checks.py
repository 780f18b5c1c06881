"""The checks of the DP fields of :class:`~hf_dp.arguments.DPArgumentsMixin`, one concern a function, each raising
with what to set instead (run by ``__post_init__``, before any model is loaded)."""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any

from .accounting import ACCOUNTANTS, check_proven_accountant
from .engine import CLIPPING_MODES
from .losses import LOSS_TYPES

logger = logging.getLogger("hf_dp.arguments")

__all__ = [
    "CLIPPING_FNS",
    "NOISE_MECHANISMS",
    "PRIVACY_UNITS",
    "TRAINER_CLIPPING_MODES",
    "check_dp_fields",
    "check_finite",
]

TRAINER_CLIPPING_MODES = sorted(m for m in CLIPPING_MODES if m != "ghost")
CLIPPING_STYLES = ["all-layer", "layer-wise", "param-wise"]
CLIPPING_FNS = ["abadi", "automatic"]
#: What the guarantee protects.
#: The noise of the gradients: independent per step (DP-SGD), or correlated across steps (banded matrix factorization).
NOISE_MECHANISMS = ("dp-sgd", "banded-toeplitz")
PRIVACY_UNITS = {"example": "one row of the training set", "user": "every row of one user (`user_column`)"}


def _parse_clipping_style(style):
    """A named style, or groups of parameter-name patterns (a list of lists, or ``"a,b;c"``)."""
    if isinstance(style, str) and style in CLIPPING_STYLES:
        return style
    if isinstance(style, str) and not any(c in style for c in ";,*?["):  # a misspelt name, not a pattern group
        raise ValueError(f"Unknown `clipping_style` {style!r}. Choose one of {CLIPPING_STYLES}, or pattern groups.")
    groups = [g.split(",") for g in style.split(";")] if isinstance(style, str) else style
    try:
        groups = [[str(p).strip() for p in group if str(p).strip()] for group in groups]
    except TypeError:
        groups = None
    if not groups or any(not g for g in groups):
        raise ValueError(
            f"`clipping_style`={style!r} is neither one of {CLIPPING_STYLES} nor non-empty groups of parameter-name "
            "patterns (a list of lists, or 'pattern,pattern;pattern')."
        )
    return groups


def check_dp_fields(args) -> None:
    """Check the DP fields, and the Trainer settings DP-SGD cannot run with, one concern after the other (the first
    problem found raises; a few fields are normalised on the way: `epsilon_accountants`, `clipping_style`,
    `max_examples_per_user`)."""
    _check_summed_gradient_clipping(args)
    _check_noise_budget(args)
    check_finite("per_sample_max_grad_norm", args.per_sample_max_grad_norm, "a clipping norm (e.g. 1.0)")
    _check_accountants(args)
    _check_clipping_policy(args)
    _check_per_example_loss(args)
    _check_poisson_sampling(args)
    _check_privacy_unit(args)
    _check_adaptive_clipping(args)
    _check_noise_mechanism(args)
    _check_unsupported_trainer_features(args)
    if args.earlier_runs not in ("count", "exclude"):
        raise ValueError(
            f"Unknown `earlier_runs` {args.earlier_runs!r}: choose 'count' (the noisy steps of earlier runs in "
            "output_dir are spent privacy) or 'exclude' (the card then says they are not covered)."
        )


def _check_summed_gradient_clipping(args) -> None:
    if args.max_grad_norm and args.max_grad_norm > 0:
        raise ValueError(
            f"`max_grad_norm`={args.max_grad_norm} is not supported by DPTrainer, because clipping the noisy "
            "summed gradient is not part of DP-SGD. Set `max_grad_norm=0` and use `per_sample_max_grad_norm`."
        )


def _check_noise_budget(args) -> None:
    """Exactly one of a budget and a noise multiplier, each in range, and a delta in (0, 1)."""
    if (args.target_epsilon is None) == (args.noise_multiplier is None):
        raise ValueError(
            "Give exactly one of `target_epsilon` (calibrate the noise to a budget) and `noise_multiplier`; got "
            f"target_epsilon={args.target_epsilon}, noise_multiplier={args.noise_multiplier}."
        )
    if args.target_epsilon is not None and not (args.target_epsilon > 0 and math.isfinite(args.target_epsilon)):
        raise ValueError(f"`target_epsilon` must be a finite number > 0, got {args.target_epsilon}.")
    if args.noise_multiplier is not None:
        check_finite("noise_multiplier", args.noise_multiplier, "a noise multiplier (e.g. 1.0)", zero=True)
    if args.noise_multiplier == 0:
        logger.warning("`noise_multiplier=0`: no noise is added and epsilon is infinite (no privacy).")
    if args.target_delta is not None and not 0 < args.target_delta < 1:
        raise ValueError(f"`target_delta` must be in (0, 1), got {args.target_delta}.")


def _check_accountants(args) -> None:
    """A proven headline accountant, and known logged ones (a comma-separated string becomes a list)."""
    check_proven_accountant(args.accountant)
    if isinstance(args.epsilon_accountants, str):
        args.epsilon_accountants = [a for a in args.epsilon_accountants.split(",") if a]
    for name in args.epsilon_accountants:
        if name not in ACCOUNTANTS:
            raise ValueError(
                f"Unknown accountant {name!r} in `epsilon_accountants`. Choose from {sorted(ACCOUNTANTS)}."
            )


def _check_clipping_policy(args) -> None:
    """The clipping mode, style (pattern groups parsed), function and its gamma."""
    if args.clipping_mode not in TRAINER_CLIPPING_MODES:
        raise ValueError(
            f"`clipping_mode`={args.clipping_mode!r} is not supported by DPTrainer. Choose one of "
            f"{TRAINER_CLIPPING_MODES} ('ghost' needs two backward passes and exists for benchmarks only)."
        )
    args.clipping_style = _parse_clipping_style(args.clipping_style)
    if args.clipping_fn not in CLIPPING_FNS:
        raise ValueError(f"Unknown `clipping_fn` {args.clipping_fn!r}. Choose one of {CLIPPING_FNS}.")
    check_finite("automatic_clipping_gamma", args.automatic_clipping_gamma, "a small constant (e.g. 0.01)")


def _check_per_example_loss(args) -> None:
    if args.per_example_loss_reduction not in ("mean", "sum"):
        raise ValueError(
            f"`per_example_loss_reduction` must be 'mean' or 'sum', got {args.per_example_loss_reduction!r}."
        )
    if args.dp_loss_type not in ("auto", *LOSS_TYPES):
        raise ValueError(f"Unknown `dp_loss_type` {args.dp_loss_type!r}. Choose one of {['auto', *LOSS_TYPES]}.")


def _check_poisson_sampling(args) -> None:
    """No Trainer setting that fixes the batch size or chooses the examples of a Poisson batch."""
    if not args.poisson_sampling:
        return
    if args.dataloader_drop_last:
        raise ValueError(
            "`dataloader_drop_last=True` is not supported with Poisson sampling, because logical batches have "
            "random sizes by design. Set `dataloader_drop_last=False` (or `poisson_sampling=False`)."
        )
    if args.train_sampling_strategy in ("sequential", "batch_rebalance"):
        kto = any(klass.__name__ == "KTOConfig" for klass in type(args).__mro__)
        raise ValueError(
            f"`train_sampling_strategy={args.train_sampling_strategy!r}` is not supported with Poisson "
            "sampling, because it chooses which examples form a batch and so breaks the sampling the "
            "accountant assumes. Use 'random', or 'group_by_length' (which only orders each Poisson batch by "
            "length before cutting it into micro-batches)."
            + (
                " TRL's KTOConfig sets 'sequential' for KTO's KL term, an estimate over the batch that couples the "
                "examples: KTO cannot be trained with per-example clipping (DPTrainerMixin refuses KTOTrainer); use "
                "DPDPOTrainer on preference pairs."
                if kto
                else ""
            )
        )


def _check_unsupported_trainer_features(args) -> None:
    """Trainer features that break per-example clipping or the sample rate."""
    if args.torch_compile:
        raise ValueError(
            "`torch_compile=True` is not supported by DPTrainer: the compiled graph bypasses the book-keeping "
            "hooks, so every clipped gradient would be zero and training would run on noise alone. Set "
            "`torch_compile=False`."
        )
    if args.neftune_noise_alpha is not None:
        raise ValueError(
            f"`neftune_noise_alpha`={args.neftune_noise_alpha} is not supported by DPTrainer, because NEFTune "
            "scales each example's embedding noise by the padded length of its micro-batch, so one example's "
            "update depends on its neighbours. Set `neftune_noise_alpha=None`."
        )
    if args.auto_find_batch_size:
        raise ValueError(
            "`auto_find_batch_size=True` is not supported by DPTrainer, because it changes the sample rate "
            "mid-training. Set `auto_find_batch_size=False`."
        )


def _check_privacy_unit(args) -> None:
    if args.privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"Unknown `privacy_unit` {args.privacy_unit!r}. Choose one of {list(PRIVACY_UNITS)}.")
    if args.privacy_unit == "example":
        if args.user_column is not None or args.max_examples_per_user is not None:
            raise ValueError(
                "`user_column`/`max_examples_per_user` are set but `privacy_unit='example'`: the guarantee would "
                "protect one row, not one user. Set `privacy_unit='user'` to protect every row of a user, or "
                "drop those two settings."
            )
        return
    if not args.user_column:
        raise ValueError("`privacy_unit='user'` needs `user_column`: the training-set column naming each row's user.")
    k = args.max_examples_per_user
    if k is None or isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(
            f"`privacy_unit='user'` needs `max_examples_per_user` (an integer >= 1), got {k!r}: it bounds how "
            "many rows of one user a logical batch holds (the rows of a user are clipped together, so it sets "
            "memory, not the guarantee)."
        )
    args.max_examples_per_user = int(k)
    if not args.poisson_sampling:
        raise ValueError(
            "`privacy_unit='user'` needs `poisson_sampling=True`: the user-level guarantee is that of users "
            "sampled independently with probability q. Shuffled batches of rows with user-level clipping are a "
            "different mechanism that hf_dp does not account."
        )
    if args.train_sampling_strategy == "group_by_length":
        raise ValueError(
            "`train_sampling_strategy='group_by_length'` is not supported with `privacy_unit='user'` (the rows of "
            "a user stay together in one micro-batch). Use 'random'."
        )


def _check_adaptive_clipping(args) -> None:
    if not args.adaptive_clipping:
        return
    if args.clipping_style != "all-layer" or args.clipping_fn != "abadi":
        raise ValueError(
            "`adaptive_clipping=True` needs `clipping_style='all-layer'` and `clipping_fn='abadi'` (one clipping "
            f"norm, and a count of units under it), got clipping_style={args.clipping_style!r}, "
            f"clipping_fn={args.clipping_fn!r}."
        )
    if args.noise_multiplier == 0:
        raise ValueError(
            "`adaptive_clipping=True` with `noise_multiplier=0`: the count of unclipped units would be published "
            "without noise. Use a noise multiplier > 0 or a target epsilon."
        )
    if not 0 < args.target_unclipped_quantile < 1:
        raise ValueError(f"`target_unclipped_quantile` must be in (0, 1), got {args.target_unclipped_quantile}.")
    check_finite("clipping_norm_lr", args.clipping_norm_lr, "a learning rate of C (e.g. 0.2)")
    if args.count_noise_multiplier is not None:
        check_finite("count_noise_multiplier", args.count_noise_multiplier, "None (the default) or e.g. 10.0")


def _check_noise_mechanism(args) -> None:
    """A known mechanism; with ``"banded-toeplitz"``: a band count >= 1, Poisson sampling, and no adaptive clipping."""
    mechanism, bands = args.noise_mechanism, args.noise_bands
    if mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"Unknown `noise_mechanism` {mechanism!r}: choose one of {list(NOISE_MECHANISMS)}.")
    if isinstance(bands, bool) or not isinstance(bands, numbers.Integral) or bands < 1:
        raise ValueError(f"`noise_bands` must be an integer >= 1 (the band count b of the noise), got {bands!r}.")
    if mechanism == "dp-sgd":
        if bands != 1:
            raise ValueError(
                f"`noise_bands={bands}` needs `noise_mechanism='banded-toeplitz'` (DP-SGD's noise has one band)."
            )
        return
    if not args.poisson_sampling:
        raise ValueError(
            "`noise_mechanism='banded-toeplitz'` needs `poisson_sampling=True`: its guarantee rests on cyclic Poisson "
            "sampling (the training set split into `noise_bands` parts, one part sampled per step)."
        )
    if args.adaptive_clipping:
        raise ValueError(
            "`adaptive_clipping=True` is not supported with `noise_mechanism='banded-toeplitz'`: the noisy count that "
            "sets the next C would be released with the correlated gradient noise, an analysis hf_dp does not make. "
            "Use a fixed `per_sample_max_grad_norm` (or `clipping_fn='automatic'`), or `noise_mechanism='dp-sgd'`."
        )


def check_finite(name: str, value: Any, what: str, *, zero: bool = False) -> None:
    """``value`` is a finite real number > 0 (>= 0 with ``zero``): an infinite clipping norm bounds nothing, an
    infinite or NaN noise multiplier states no mechanism, and no guarantee can be stated for either."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and (value >= 0 if zero else value > 0)):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(
            f"`{name}` must be a finite number {bound}, got {value!r}: no differential-privacy guarantee holds for it. "
            f"Set `{name}` to {what}."
        )
