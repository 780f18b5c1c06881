"""``DPTrainingArguments`` / ``DPSeq2SeqTrainingArguments``: the Trainer's arguments plus the DP settings.

The DP fields and their checks live once, in :class:`DPArgumentsMixin`; each arguments class is that mixin on top of
the matching transformers class, so a seq2seq script changes the same names as any other script.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from .accounting import PROVEN_ACCOUNTANTS
from .argument_checks import (
    CLIPPING_FNS,
    NOISE_MECHANISMS,
    PRIVACY_UNITS,
    TRAINER_CLIPPING_MODES,
    check_dp_fields,
)
from .losses import LOSS_TYPES

logger = logging.getLogger(__name__)

__all__ = ["DPArgumentsMixin", "DPSeq2SeqTrainingArguments", "DPTrainingArguments"]

_DP_PARAMETERS_DOC = r"""
    > Parameters that control the privacy guarantee

    target_epsilon (`float`, *optional*, defaults to `None`):
        Privacy budget. The noise multiplier is calibrated when training starts (taking into account the privacy
        already spent when resuming) so that the planned number of steps ends at epsilon <= `target_epsilon` under
        `accountant`; training stops if it would go past it. Give exactly one of `target_epsilon` and
        `noise_multiplier`.
    noise_multiplier (`float`, *optional*, defaults to `None`):
        Noise standard deviation divided by `per_sample_max_grad_norm`. Give exactly one of the two.
    target_delta (`float`, *optional*, defaults to `None`):
        delta of the (epsilon, delta) guarantee. `None` means `1 / (2 N)` with `N` the training set size; it must stay
        below `1 / N`.
    per_sample_max_grad_norm (`float`, *optional*, defaults to `0.1`):
        Clipping norm `C` of each example's gradient (Li et al. 2022 recommend a small C such as 0.1).
    accountant (`str`, *optional*, defaults to `"rdp"`):
        Accountant for calibration, the budget stop, the `epsilon` log key and the model card's headline: `"rdp"` or
        `"prv"` (PRV upper bound). Both are proven upper bounds; GDP (a CLT estimate that can under-estimate) is not
        accepted here and can only be logged through `epsilon_accountants`.
    epsilon_accountants (`list[str]`, *optional*, defaults to `["rdp", "prv"]`):
        Accountants whose epsilon is logged as `epsilon_<name>` at each logging step; `"gdp"` is logged as an
        estimate.

    > Parameters that control sampling, clipping and the noise

    poisson_sampling (`bool`, *optional*, defaults to `True`):
        Draw each logical batch by including every example independently with probability
        `q = per_device_train_batch_size * gradient_accumulation_steps * world_size / N` (what the accountants
        assume). `False` uses shuffled fixed-size batches, for which the accounting is only a heuristic.
        With `train_sampling_strategy="group_by_length"` each Poisson batch is ordered by length before it is cut
        into micro-batches (less padding, same examples per step, same guarantee); `"sequential"` and
        `"batch_rebalance"` are errors, because they choose the examples of a batch.
    clipping_mode (`str`, *optional*, defaults to `"bk-mixopt"`):
        `"bk-mixopt"` (per layer, the cheaper of ghost norm and instantiation), `"bk"` (ghost norm everywhere)
        or `"per-sample"` (instantiate every per-example gradient).
    clipping_style (`str` or `list[list[str]]`, *optional*, defaults to `"all-layer"`):
        How per-example gradients are grouped for clipping: `"all-layer"` (one norm over all parameters), `"layer-wise"`
        (one group per module; tied parameters share a group), `"param-wise"` (one group per parameter), or groups of
        parameter-name patterns (`fnmatch`), given as a list of lists or on the command line as
        `"pattern,pattern;pattern"` (`;` between groups). Each of the G groups is clipped at `C / sqrt(G)` (He et al.
        2022), so the sensitivity stays `C` and the guarantee is unchanged. Layer-wise clipping forms each layer's
        clipped sum inside its own backward hook and frees its book-kept inputs there: memory close to non-private.
    clipping_fn (`str`, *optional*, defaults to `"abadi"`):
        `"abadi"`: `min(1, C / ||g_i||)`; `"automatic"` (Bu et al. 2023): `C / (||g_i|| + gamma)`, which normalises
        every per-example gradient (no clipping threshold to tune: with it the learning rate absorbs `C`). Use it to
        avoid tuning `C`; the sensitivity is `C` either way.
    automatic_clipping_gamma (`float`, *optional*, defaults to `0.01`):
        `gamma` of automatic clipping (> 0): the stability constant that keeps small gradients from being blown up.
    per_example_loss_reduction (`str`, *optional*, defaults to `"mean"`):
        How one example's token losses are combined: `"mean"` over its own target tokens, or `"sum"`.
    dp_loss_type (`str`, *optional*, defaults to `"auto"`):
        Per-example loss: `"causal_lm"`, `"masked_lm"`, `"seq2seq_lm"`, `"sequence_classification"`,
        `"token_classification"`, `"question_answering"`, `"multiple_choice"`, or `"auto"` (from the model class).
        Formerly `loss_type`, which still works (with a `FutureWarning`) in `DPTrainingArguments` and
        `DPSeq2SeqTrainingArguments`; in the TRL configurations (`DPSFTConfig`, ...) `loss_type` is TRL's own field.
    dp_self_check (`bool`, *optional*, defaults to `True`):
        On the first micro-batch, compare the engine's per-example gradient norms of a few examples with plain
        per-example autograd and stop with an error naming the parameters that differ: catches an architecture the
        engine gets wrong before any privacy is spent. Runs once, on the first two examples of the micro-batch: one
        engine pass on them and plain autograd on each, in the mode training runs the model in (with dropout: the same
        random draws for both); the checks of the whole micro-batch (each loss depends on its own example) run on it as
        always.
    secure_mode (`bool`, *optional*, defaults to `False`):
        Draw the noise and the Poisson batches from the operating system's cryptographically secure generator (the
        noise by Box-Muller, four normals per coordinate against floating-point attacks, as Opacus's secure mode).
        Slower (about 32 random bytes per parameter per step). By default they come from torch's and NumPy's
        generators, seeded from the operating system at every start and never written anywhere.
    noise_seed (`int`, *optional*, defaults to `None`):
        FOR TESTS ONLY. A fixed seed makes the noise of every step, and the Poisson batches (seeded by `data_seed` or
        `seed`), reproducible, so that a resumed run is bit-identical to an uninterrupted one. Anyone who knows it
        can remove the noise: the model card then says the guarantee does not hold. `None` (default): seeded from the
        operating system, never written to disk.
    noise_mechanism (`str`, *optional*, defaults to `"dp-sgd"`):
        `"dp-sgd"`: independent Gaussian noise at every step. `"banded-toeplitz"`: noise correlated across steps
        (banded matrix factorization, Choquette-Choo et al. 2023): at step t the t-th row of `C^-1 Z`, with `C` a
        lower-triangular banded Toeplitz matrix of `noise_bands` bands optimized for the prefix sums of the steps, so
        that the noise of consecutive steps partly cancels in the model. Sampling is then cyclic Poisson: the training
        set is split into `noise_bands` fixed parts by the run's secret seed, and step t samples part `t mod b` with
        probability `b L / N`. Needs `poisson_sampling=True`; refuses `adaptive_clipping`. The noise state (b - 1
        parameter-sized tensors of the trainable parameters) never leaves the process, so a run cannot be resumed
        from a checkpoint except with a fixed `noise_seed` (tests). See docs/bandmf.md.
    noise_bands (`int`, *optional*, defaults to `1`):
        `b`, the band count of `noise_mechanism="banded-toeplitz"` (1 gives DP-SGD exactly). `b L` must not exceed
        `N` (each part must hold at least the expected batch).
    publish_training_metrics (`bool`, *optional*, defaults to `False`):
        Write un-noised statistics of the training data (training loss, token counts, FLOs, run time) into released
        files (`trainer_state.json`, `*_results.json`, the model card). They are not covered by the guarantee, and
        the card says so. By default they stay in local logs (console, progress bar, `report_to`) only.

    > Parameters that choose the unit of privacy and adapt the clipping norm

    privacy_unit (`str`, *optional*, defaults to `"example"`):
        What the (epsilon, delta) guarantee protects: `"example"` (one row of the training set) or `"user"` (every row
        of one person, named by `user_column`). With `"user"` each logical batch includes each user independently with
        probability `q = L / N_users` (`L = per_device_train_batch_size * gradient_accumulation_steps * world_size`
        users expected per step), a sampled user contributes a fresh random subset of at most
        `max_examples_per_user` of its rows, all in one micro-batch, and the sum of that user's per-example gradients
        is clipped as one (`||sum_{i in u} g_i|| <= C`). `N`, the default delta and the checks count users.
    user_column (`str`, *optional*, defaults to `None`):
        The column of the training set that names the user of each row (any hashable value; no missing values).
        Required with `privacy_unit="user"`.
    max_examples_per_user (`int`, *optional*, defaults to `None`):
        `k`: the most rows of one user in a logical batch (required with `privacy_unit="user"`). A micro-batch then
        holds up to `k` rows per user, so memory grows with `k`.
    adaptive_clipping (`bool`, *optional*, defaults to `False`):
        Quantile-adaptive clipping (Andrew et al. 2021): after every step, `C <- C * exp(-clipping_norm_lr * (b -
        target_unclipped_quantile))`, with `b` the noisy fraction of units whose gradient norm was at most `C`;
        `per_sample_max_grad_norm` is the starting `C`. The count is released with noise `count_noise_multiplier`,
        and the gradient's noise multiplier is raised so that both together spend exactly the privacy of
        `noise_multiplier` (the accountant's sigma): `sigma_grad = (sigma^-2 - (2 sigma_count)^-2)^-1/2`. Needs
        `clipping_style="all-layer"` and `clipping_fn="abadi"`.
    target_unclipped_quantile (`float`, *optional*, defaults to `0.5`):
        The fraction of units whose gradient norm should stay below `C`, in (0, 1).
    clipping_norm_lr (`float`, *optional*, defaults to `0.2`):
        Learning rate of the geometric update of `C` (> 0).
    count_noise_multiplier (`float`, *optional*, defaults to `None`):
        Standard deviation of the noise on the count of unclipped units (> `sigma / 2`). `None`: `L / 20` (the
        paper's recommendation), or `sigma` if that is larger (small batches: the gradient's noise then grows 15%).

    > Parameters that control the privacy record

    earlier_runs (`str`, *optional*, defaults to `"count"`):
        What to do with the noisy steps of other runs that `output_dir`'s privacy ledger records (a run that crashed
        before its first checkpoint, an earlier run in the same folder): `"count"` them as spent (the stated epsilon,
        the budget and the calibration of sigma cover them), or `"exclude"` them (the console and the model card
        then say that the stated epsilon does not cover them). Use a new `output_dir` for an unrelated run.

    > [!NOTE]
    > Changed defaults: `max_grad_norm=0.0`. Clipping the summed gradient after the noise is added (what
    > `max_grad_norm` does) is not part of DP-SGD; any value > 0 is an error.
"""


@dataclass
class DPArgumentsMixin:
    """The differential-privacy fields shared by every DP arguments class, and their checks."""

    # Re-declared: HF clipping after privatisation is wrong.
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Must stay 0: DP clipping is per example (`per_sample_max_grad_norm`), never on the sum."},
    )
    target_epsilon: float | None = field(
        default=None,
        metadata={
            "help": "Privacy budget epsilon (> 0); sigma is calibrated when training starts to reach it at the last "
            "step. Exactly one of `target_epsilon` and `noise_multiplier`."
        },
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "Noise std / clipping norm (>= 0). Exactly one of `target_epsilon` and `noise_multiplier`."},
    )
    target_delta: float | None = field(
        default=None, metadata={"help": "delta in (0, 1/N). None: 1 / (2 N), N = number of training examples."}
    )
    per_sample_max_grad_norm: float = field(
        default=0.1, metadata={"help": "Per-example clipping norm C (> 0), in gradient-norm units."}
    )
    accountant: str = field(
        default="rdp",
        metadata={
            "help": "Proven accountant for calibration, the budget stop, the `epsilon` log key and the card's "
            "headline (GDP is an estimate: log it with `epsilon_accountants`).",
            "choices": sorted(PROVEN_ACCOUNTANTS),
        },
    )
    epsilon_accountants: list[str] = field(
        default_factory=lambda: ["rdp", "prv"],
        metadata={"help": "Accountants logged as `epsilon_<name>` at each logging step ('gdp': an estimate)."},
    )
    poisson_sampling: bool = field(
        default=True, metadata={"help": "Poisson sampling of logical batches (what the accountants assume)."}
    )
    clipping_mode: str = field(
        default="bk-mixopt",
        metadata={"help": "Per-example clipping algorithm.", "choices": TRAINER_CLIPPING_MODES},
    )
    clipping_style: str = field(
        default="all-layer",
        metadata={
            "help": "'all-layer', 'layer-wise', 'param-wise', or parameter-name pattern groups 'a,b;c' (';' between "
            "groups); each of G groups is clipped at C / sqrt(G)."
        },
    )
    clipping_fn: str = field(
        default="abadi",
        metadata={"help": "'abadi': min(1, C/||g||); 'automatic': C / (||g|| + gamma).", "choices": CLIPPING_FNS},
    )
    automatic_clipping_gamma: float = field(default=0.01, metadata={"help": "gamma of automatic clipping (> 0)."})
    per_example_loss_reduction: str = field(
        default="mean",
        metadata={"help": "'mean' over the example's own target tokens, or 'sum'.", "choices": ["mean", "sum"]},
    )
    dp_loss_type: str = field(
        default="auto",
        metadata={"help": "Per-example loss; 'auto' picks it from the model class.", "choices": ["auto", *LOSS_TYPES]},
    )
    dp_self_check: bool = field(
        default=True,
        metadata={"help": "Check the engine's per-example norms against plain autograd on the first micro-batch."},
    )
    secure_mode: bool = field(
        default=False,
        metadata={"help": "Noise and Poisson draws from the OS's cryptographically secure generator (slower)."},
    )
    noise_seed: int | None = field(
        default=None,
        metadata={
            "help": "TESTS ONLY: a fixed noise seed lets anyone remove the noise. None: from the OS, never saved."
        },
    )
    noise_mechanism: str = field(
        default="dp-sgd",
        metadata={
            "help": "'dp-sgd' (independent noise per step) or 'banded-toeplitz' (noise correlated across steps, "
            "with cyclic Poisson sampling).",
            "choices": list(NOISE_MECHANISMS),
        },
    )
    noise_bands: int = field(
        default=1, metadata={"help": "Band count b of noise_mechanism='banded-toeplitz' (1: DP-SGD exactly)."}
    )
    publish_training_metrics: bool = field(
        default=False,
        metadata={"help": "Write the un-noised training loss/token counts into released files (not covered)."},
    )
    privacy_unit: str = field(
        default="example",
        metadata={
            "help": "What the guarantee protects: one row ('example') or one user ('user').",
            "choices": list(PRIVACY_UNITS),
        },
    )
    user_column: str | None = field(
        default=None, metadata={"help": "Training-set column naming each row's user (privacy_unit='user')."}
    )
    max_examples_per_user: int | None = field(
        default=None, metadata={"help": "Most rows of one user in a logical batch (privacy_unit='user')."}
    )
    adaptive_clipping: bool = field(
        default=False, metadata={"help": "Quantile-adaptive clipping norm (Andrew et al. 2021), exactly accounted."}
    )
    target_unclipped_quantile: float = field(
        default=0.5, metadata={"help": "Adaptive clipping: fraction of units to leave unclipped, in (0, 1)."}
    )
    clipping_norm_lr: float = field(default=0.2, metadata={"help": "Adaptive clipping: learning rate of C (> 0)."})
    count_noise_multiplier: float | None = field(
        default=None, metadata={"help": "Adaptive clipping: noise std of the unclipped count (None: max(L/20, sigma))."}
    )
    earlier_runs: str = field(
        default="count",
        metadata={
            "help": "Noisy steps of other runs in output_dir's privacy ledger: 'count' them as spent, or 'exclude' "
            "them (the card then says they are not covered).",
            "choices": ["count", "exclude"],
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_dp_fields(self)


def _dp_doc(base: str) -> str:
    return (
        f"Configuration for [`{base}`]-style DP training: every field of the transformers arguments class it extends,"
        f" plus the ones below.\n\n    Parameters:{_DP_PARAMETERS_DOC}"
    )


@dataclass
class _LossTypeAlias:
    """``loss_type``: the deprecated name of ``dp_loss_type`` in the transformers-based arguments classes (the TRL
    configurations have their own ``loss_type`` with TRL's meaning, so the DP field is ``dp_loss_type`` everywhere)."""

    loss_type: str | None = field(
        default=None,
        metadata={"help": "Deprecated: use `dp_loss_type` (the same values)."},
    )

    def __post_init__(self):
        if self.loss_type is not None:
            warnings.warn(
                "`loss_type` of the hf_dp arguments is deprecated and will be removed: use `dp_loss_type` (the same "
                "values). It was renamed because TRL's configurations have a `loss_type` field of their own.",
                FutureWarning,
                stacklevel=3,
            )
            if self.dp_loss_type not in ("auto", self.loss_type):
                raise ValueError(
                    f"Got both `loss_type={self.loss_type!r}` (deprecated) and `dp_loss_type={self.dp_loss_type!r}`. "
                    "Set `dp_loss_type` only."
                )
            self.dp_loss_type = self.loss_type
        super().__post_init__()


@dataclass
class DPTrainingArguments(_LossTypeAlias, DPArgumentsMixin, TrainingArguments):
    __doc__ = _dp_doc("DPTrainer")


@dataclass
class DPSeq2SeqTrainingArguments(_LossTypeAlias, DPArgumentsMixin, Seq2SeqTrainingArguments):
    __doc__ = _dp_doc("DPSeq2SeqTrainer") + (
        "\n    Every [`~transformers.Seq2SeqTrainingArguments`] field (`predict_with_generate`, "
        "`generation_max_length`, `generation_num_beams`, `generation_config`) keeps its meaning."
    )
