"""``DPTrainingArguments``: ``TrainingArguments`` plus the differential-privacy settings."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .accounting import ACCOUNTANTS
from .engine import CLIPPING_MODES

logger = logging.getLogger(__name__)

__all__ = ["DPTrainingArguments"]

TRAINER_CLIPPING_MODES = sorted(m for m in CLIPPING_MODES if m != "ghost")
LOSS_TYPES = ["auto", "causal_lm", "masked_lm", "seq2seq_lm", "sequence_classification", "token_classification"]


@dataclass
class DPTrainingArguments(TrainingArguments):
    r"""
    Configuration for [`DPTrainer`]: every [`~transformers.TrainingArguments`] field, plus the ones below.

    Parameters:
        > Parameters that control the privacy guarantee

        target_epsilon (`float`, *optional*, defaults to `None`):
            Privacy budget. The noise multiplier is calibrated, before training, so that the planned number of steps
            ends at epsilon <= `target_epsilon` under `accountant`; training stops if it would go past it. Give
            exactly one of `target_epsilon` and `noise_multiplier`.
        noise_multiplier (`float`, *optional*, defaults to `None`):
            Noise standard deviation divided by `per_sample_max_grad_norm`. Give exactly one of the two.
        target_delta (`float`, *optional*, defaults to `None`):
            delta of the (epsilon, delta) guarantee. `None` means `1 / (2 N)` with `N` the training set size.
        per_sample_max_grad_norm (`float`, *optional*, defaults to `0.1`):
            Clipping norm `C` of each example's gradient (Li et al. 2022 recommend a small C such as 0.1).
        accountant (`str`, *optional*, defaults to `"rdp"`):
            Accountant used for calibration, for the budget stop and for the `epsilon` log key: `"rdp"`, `"prv"`
            (upper bound) or `"gdp"` (CLT approximation; can underestimate).
        epsilon_accountants (`list[str]`, *optional*, defaults to `["rdp", "prv"]`):
            Accountants whose epsilon is logged as `epsilon_<name>` at each logging step.

        > Parameters that control sampling and clipping

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
        per_example_loss_reduction (`str`, *optional*, defaults to `"mean"`):
            How one example's token losses are combined: `"mean"` over its own target tokens, or `"sum"`.
        loss_type (`str`, *optional*, defaults to `"auto"`):
            Per-example loss: `"causal_lm"`, `"masked_lm"`, `"seq2seq_lm"`, `"sequence_classification"`,
            `"token_classification"`, or `"auto"` (from the model class).
        noise_seed (`int`, *optional*, defaults to `None`):
            Seed of the noise generator. `None` draws a seed from the operating system; the generator state is saved
            with checkpoints either way. A known seed lets anyone remove the noise: use it for tests only.

    > [!NOTE]
    > Changed defaults: `max_grad_norm=0.0`. Clipping the summed gradient after the noise is added (what
    > `max_grad_norm` does) is not part of DP-SGD; any value > 0 is an error.
    """

    # Re-declared: HF clipping after privatisation is wrong.
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Must stay 0: DP clipping is per example (`per_sample_max_grad_norm`), never on the sum."},
    )
    target_epsilon: float | None = field(
        default=None,
        metadata={
            "help": "Privacy budget epsilon (> 0); sigma is calibrated to reach it at the last step. "
            "Exactly one of `target_epsilon` and `noise_multiplier`."
        },
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "Noise std / clipping norm (>= 0). Exactly one of `target_epsilon` and `noise_multiplier`."},
    )
    target_delta: float | None = field(
        default=None, metadata={"help": "delta in (0, 1). None: 1 / (2 N), N = number of training examples."}
    )
    per_sample_max_grad_norm: float = field(
        default=0.1, metadata={"help": "Per-example clipping norm C (> 0), in gradient-norm units."}
    )
    accountant: str = field(
        default="rdp",
        metadata={
            "help": "Accountant for calibration, the budget stop and the `epsilon` log key.",
            "choices": sorted(ACCOUNTANTS),
        },
    )
    epsilon_accountants: list[str] = field(
        default_factory=lambda: ["rdp", "prv"],
        metadata={"help": "Accountants logged as `epsilon_<name>` at each logging step (PRV is cached)."},
    )
    poisson_sampling: bool = field(
        default=True, metadata={"help": "Poisson sampling of logical batches (what the accountants assume)."}
    )
    clipping_mode: str = field(
        default="bk-mixopt",
        metadata={"help": "Per-example clipping algorithm.", "choices": TRAINER_CLIPPING_MODES},
    )
    per_example_loss_reduction: str = field(
        default="mean",
        metadata={"help": "'mean' over the example's own target tokens, or 'sum'.", "choices": ["mean", "sum"]},
    )
    loss_type: str = field(
        default="auto",
        metadata={"help": "Per-example loss; 'auto' picks it from the model class.", "choices": LOSS_TYPES},
    )
    noise_seed: int | None = field(
        default=None,
        metadata={"help": "Noise generator seed; None: drawn from the OS. A known seed voids privacy (tests only)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.max_grad_norm and self.max_grad_norm > 0:
            raise ValueError(
                f"`max_grad_norm`={self.max_grad_norm} is not supported by DPTrainer, because clipping the noisy "
                "summed gradient is not part of DP-SGD. Set `max_grad_norm=0` and use `per_sample_max_grad_norm`."
            )
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "Give exactly one of `target_epsilon` (calibrate the noise to a budget) and `noise_multiplier`; got "
                f"target_epsilon={self.target_epsilon}, noise_multiplier={self.noise_multiplier}."
            )
        if self.target_epsilon is not None and not (self.target_epsilon > 0 and math.isfinite(self.target_epsilon)):
            raise ValueError(f"`target_epsilon` must be a finite number > 0, got {self.target_epsilon}.")
        if self.noise_multiplier is not None and not self.noise_multiplier >= 0:
            raise ValueError(f"`noise_multiplier` must be >= 0, got {self.noise_multiplier}.")
        if self.noise_multiplier == 0:
            logger.warning("`noise_multiplier=0`: no noise is added and epsilon is infinite (no privacy).")
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            raise ValueError(f"`target_delta` must be in (0, 1), got {self.target_delta}.")
        if not self.per_sample_max_grad_norm > 0:
            raise ValueError(f"`per_sample_max_grad_norm` must be > 0, got {self.per_sample_max_grad_norm}.")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"Unknown `accountant` {self.accountant!r}. Choose one of {sorted(ACCOUNTANTS)}.")
        if isinstance(self.epsilon_accountants, str):
            self.epsilon_accountants = [a for a in self.epsilon_accountants.split(",") if a]
        for name in self.epsilon_accountants:
            if name not in ACCOUNTANTS:
                raise ValueError(
                    f"Unknown accountant {name!r} in `epsilon_accountants`. Choose from {sorted(ACCOUNTANTS)}."
                )
        if self.clipping_mode not in TRAINER_CLIPPING_MODES:
            raise ValueError(
                f"`clipping_mode`={self.clipping_mode!r} is not supported by DPTrainer. Choose one of "
                f"{TRAINER_CLIPPING_MODES} ('ghost' needs two backward passes and exists for benchmarks only)."
            )
        if self.per_example_loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"`per_example_loss_reduction` must be 'mean' or 'sum', got {self.per_example_loss_reduction!r}."
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown `loss_type` {self.loss_type!r}. Choose one of {LOSS_TYPES}.")
        if self.poisson_sampling:
            if self.dataloader_drop_last:
                raise ValueError(
                    "`dataloader_drop_last=True` is not supported with Poisson sampling, because logical batches have "
                    "random sizes by design. Set `dataloader_drop_last=False` (or `poisson_sampling=False`)."
                )
            if self.train_sampling_strategy in ("sequential", "batch_rebalance"):
                raise ValueError(
                    f"`train_sampling_strategy={self.train_sampling_strategy!r}` is not supported with Poisson "
                    "sampling, because it chooses which examples form a batch and so breaks the sampling the "
                    "accountant assumes. Use 'random', or 'group_by_length' (which only orders each Poisson batch by "
                    "length before cutting it into micro-batches)."
                )
        if self.gradient_checkpointing:
            raise ValueError(
                "`gradient_checkpointing=True` is not supported by DPTrainer yet: the recomputed forward pass does not "
                "produce the output gradients book-keeping hooks. Set `gradient_checkpointing=False` and lower "
                "`per_device_train_batch_size` (raise `gradient_accumulation_steps` to keep the logical batch)."
            )
