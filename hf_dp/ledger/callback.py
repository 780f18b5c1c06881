"""``DPCallback``: the privacy spent by a run (accountant history), the budget stop, and checkpoints."""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..accounting import PrivacyAccountant, banded_participations
from ..accounting.methods import segments_epsilon
from ..plan.privacy_plan import DPPlan
from ..release.filter import release_state
from .ledger import PrivacyLedger

logger = logging.getLogger(__name__)

__all__ = ["DPCallback"]

_MAX_BUDGET_STEPS = 10**8


class DPCallback(TrainerCallback, ExportableState):
    """Holds the accountant of a run and stops training before the privacy budget would be exceeded.

    The trainer records every noisy step where it adds the noise (:meth:`record_step`, with the sigma and q that step
    used), so the history follows what actually happened, segment by segment, whatever resume path rebuilt this
    callback. What it saves in ``trainer_state.json`` is the spent privacy and the bookkeeping a resume needs (history,
    training set size, the first draw of the current ``train()`` call, the calibration plan); it holds no secret: the
    noise and sampling seeds never reach it (DESIGN §4 rule 14). It acts on training only through ``control``.

    The run's settings (``noise_multiplier``, ``sample_rate``, ``delta``, ``accountant``, ``epsilon_budget``) are set
    by the trainer with :meth:`configure` before every ``train()``, from the run's frozen plan; they are not saved, so a
    callback rebuilt from a checkpoint never accounts future steps with the checkpoint's settings. With the frozen
    plan, the callback checks at every optimizer step (begin and end) and at the end of training that the arguments'
    privacy settings still are the plan's (:meth:`DPPlan.check_unchanged`), and it appends every recorded step to the
    run's privacy ledger (:class:`~hf_dp.ledger.ledger.PrivacyLedger`) when it records it (``fsync``-ed at saves and at
    the end of training).

    Saved with checkpoints besides the history: ``run_id`` (the run's identity in the ledger),
    ``data_fingerprint`` (:func:`~hf_dp.ledger.fingerprint.data_fingerprint` of the training set) and
    ``ledger_head`` (the hash of the run's last ledger line), which a resume checks; ``carried`` (the noisy steps of
    earlier runs in the same output folder that this run counts as spent) and ``not_covered`` (what the stated
    epsilon leaves out, said on the console and the card); with adaptive clipping, the clipping norm of every step and
    of the next one (noisy releases: post-processing).
    """

    def __init__(self) -> None:
        self.accountant = PrivacyAccountant()
        self.delta: float | None = None
        self.epsilon_budget: float | None = None
        self.num_examples: int | None = None
        self.draw_offset = 0
        self.plan: dict[str, Any] = {}
        self.run_id: str | None = None
        self.data_fingerprint: dict[str, Any] | None = None
        #: Adaptive clipping: the clipping norm C of every step taken (in order), and the C of the next step.
        self.clip_norms: list[float] = []
        self.next_clip_norm: float | None = None
        #: The hash of the run's last ledger line ("" before its first step).
        self.ledger_head = ""
        #: Earlier runs of this output folder counted as spent: ``{"run": id, "history": [[sigma, q, steps], ...]}``.
        self.carried: list[dict[str, Any]] = []
        #: What the stated epsilon does not cover (one sentence each).
        self.not_covered: list[str] = []
        #: Prefixes of evaluation metrics computed on the training set: withheld from the saved trainer state.
        self.withheld_metrics: tuple[str, ...] = ()
        #: ``b`` of this run's banded noise (1: DP-SGD): T steps of this run account as ``ceil(T / b)`` DP-SGD steps.
        self.bands = 1
        self._budget_steps: int | None = None
        self._frozen: DPPlan | None = None
        self._ledger: PrivacyLedger | None = None

    def configure(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        delta: float,
        accountant: str,
        epsilon_budget: float | None,
        num_examples: int,
        frozen_plan: DPPlan | None = None,
        ledger: PrivacyLedger | None = None,
        bands: int = 1,
    ) -> None:
        """This run's settings: sigma and q of future steps, delta, the headline accountant and the budget; the frozen
        plan the arguments are checked against while training (``None``: no check), the ledger every recorded
        step is appended to (``None``: none, e.g. on processes other than the main one), and ``bands``, the band
        count of banded correlated noise (the run's steps then account as ``ceil(T / b)`` DP-SGD steps each segment).
        """
        self.bands = int(bands)
        self.accountant.noise_multiplier = noise_multiplier
        self.accountant.sample_rate = sample_rate
        self.accountant.accountant = accountant
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.num_examples = num_examples
        self._frozen = frozen_plan
        if ledger is not self._ledger and self._ledger is not None:
            self._ledger.flush()
        self._ledger = ledger

    # ------------------------------------------------------------------ state
    @property
    def noise_multiplier(self) -> float | None:
        return self.accountant.noise_multiplier

    @property
    def sample_rate(self) -> float | None:
        return self.accountant.sample_rate

    @property
    def history(self) -> list[list[float]]:
        """``[sigma, q, steps]`` segments, in order."""
        return self.accountant.history

    @history.setter
    def history(self, value: list[list[float]]) -> None:
        self.accountant.history = [[float(s), float(q), int(n)] for s, q, n in value]

    @property
    def spent_history(self) -> list[list[float]]:
        """Every segment the stated epsilon covers: the carried earlier runs', then this run's."""
        return [list(s) for run in self.carried for s in run["history"]] + [list(s) for s in self.history]

    def accounted_history(self, future: int = 0) -> list[tuple[float, float, int]]:
        """The segments epsilon is computed from: the carried earlier runs' (as their ledgers record them, every step
        a DP-SGD step: an over-count for a banded run, never an under-count), then this run's with ``future`` more
        steps at the configured sigma and q, each of its segments of ``T`` steps counted as ``ceil(T / b)`` steps
        (the amplified analysis of ``b``-banded noise with cyclic Poisson sampling; ``T`` for DP-SGD)."""
        own = [[float(s), float(q), int(n)] for s, q, n in self.history]
        if future > 0:
            same = own and own[-1][:2] == [float(self.noise_multiplier), float(self.sample_rate)]
            if same and self.bands > 1:  # one banded mechanism: ceil((T + n) / b) participations
                own[-1][2] += future
            else:
                own.append([float(self.noise_multiplier), float(self.sample_rate), future])
        carried = [(float(s[0]), float(s[1]), int(s[2])) for run in self.carried for s in run["history"]]
        return carried + [(s, q, banded_participations(n, self.bands)) for s, q, n in own]

    @property
    def carried_steps(self) -> int:
        """Noisy steps of earlier runs counted as spent."""
        return sum(int(s[2]) for run in self.carried for s in run["history"])

    def state(self) -> dict[str, Any]:
        return {
            "args": {},
            "attributes": {
                "history": self.history,
                "num_examples": self.num_examples,
                "draw_offset": self.draw_offset,
                "plan": self.plan,
                "run_id": self.run_id,
                "data_fingerprint": self.data_fingerprint,
                "clip_norms": self.clip_norms,
                "next_clip_norm": self.next_clip_norm,
                "ledger_head": self._ledger.head if self._ledger is not None else self.ledger_head,
                "carried": self.carried,
                "not_covered": self.not_covered,
            },
        }

    _SAVED = (
        "history",
        "num_examples",
        "draw_offset",
        "plan",
        "run_id",
        "data_fingerprint",
        "clip_norms",
        "next_clip_norm",
        "ledger_head",
        "carried",
        "not_covered",
    )

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the attributes saved by :meth:`state` (what the Trainer does when restoring callback states)."""
        for name, value in state.get("attributes", {}).items():
            if name in self._SAVED:
                setattr(self, name, value)

    # ------------------------------------------------------------------ privacy
    @property
    def steps(self) -> int:
        """Noisy steps recorded so far (all ``train()`` calls and resumed segments)."""
        return self.accountant.steps

    def record_step(self, *, noise_multiplier: float, sample_rate: float, max_grad_norm: float | None = None) -> None:
        """One noisy step with these settings (called where the noise is added), appended to the ledger at once:
        before the optimizer applies it, so no model anybody sees can come from a step the ledger lacks."""
        if self._ledger is not None:
            self._ledger.record(self.steps, noise_multiplier, sample_rate, max_grad_norm)
            self._ledger.flush()
            self.ledger_head = self._ledger.head
        self.accountant.step(1, noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def write_ledger_copy(self, folder: str) -> None:
        """The run's ledger lines into ``folder`` (a checkpoint: its history travels with it); main process only."""
        if self._ledger is not None:
            self._ledger.write_copy(folder)

    def record_clip_norm(self, used: float, next_clip_norm: float) -> None:
        """Adaptive clipping: the C a step used and the C of the next step (noisy releases: post-processing)."""
        self.clip_norms.append(used)
        self.next_clip_norm = next_clip_norm

    def check_settings(self, args, step: int | None = None) -> None:
        """Raise :class:`~hf_dp.plan.privacy_plan.FrozenSettingsError` if the privacy settings of ``args`` are no longer
        those of the run's frozen plan (no-op outside ``train()``)."""
        if self._frozen is not None:
            self._frozen.check_unchanged(args, step=step)

    def flush_ledger(self, *, sync: bool = False) -> None:
        """Write the recorded steps not yet in the ledger."""
        if self._ledger is not None:
            self._ledger.flush(sync=sync)

    def epsilon(self, accountant: str | None = None) -> float:
        """Epsilon spent so far (``math.inf`` with zero noise)."""
        if self.delta is None:
            raise RuntimeError("DPCallback.configure() was not called: delta is unknown.")
        if not self.carried and self.bands == 1:
            return self.accountant.epsilon(self.delta, accountant)
        return segments_epsilon(self.accounted_history(), self.delta, accountant or self.accountant.accountant)

    def steps_within_budget(self, max_future: int | None = None) -> int | None:
        """Total number of steps (taken and future, at the configured sigma and q) that keeps epsilon within budget.

        Args:
            max_future (`int`, *optional*): search no further than this many future steps (the steps the schedule can
                still take): the answer is then ``steps + max_future`` when all of them fit.
        """
        if self.epsilon_budget is None:
            return None
        if self.noise_multiplier == 0:
            return self.steps

        def within(n: int) -> bool:
            segments = self.accounted_history(future=n)
            return segments_epsilon(segments, self.delta, self.accountant.accountant) <= self.epsilon_budget

        if not within(0):
            return self.steps
        if max_future is not None and within(max_future):
            return self.steps + max_future
        limit = max_future if max_future is not None else _MAX_BUDGET_STEPS
        high = 1
        while within(high):  # terminates: within(max_future) is False when a limit is given
            if high >= limit:
                return None
            high = min(high * 2, limit)
        low = high // 2
        while high - low > 1:
            mid = (low + high) // 2
            if within(mid):
                low = mid
            else:
                high = mid
        return self.steps + low

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, **kwargs):
        # Every later save of this state (checkpoints, save_state) writes only released statistics.
        release_state(state, getattr(args, "publish_training_metrics", False), self.withheld_metrics)
        remaining = state.max_steps - state.global_step if state.max_steps and state.max_steps > 0 else None
        self._budget_steps = self.steps_within_budget(remaining)
        if self._budget_steps is not None and self._budget_steps <= self.steps:
            logger.warning("The privacy budget epsilon=%s is already spent; training stops.", self.epsilon_budget)
            control.should_training_stop = True
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self.check_settings(args, state.global_step + 1)  # before any micro-batch of the step
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.check_settings(args, state.global_step)
        if self._budget_steps is not None and self.steps >= self._budget_steps:
            if state.max_steps and state.global_step < state.max_steps:
                logger.warning(
                    "Stopping at step %d: one more step would exceed the privacy budget epsilon=%s (%s).",
                    state.global_step,
                    self.epsilon_budget,
                    self.accountant.accountant,
                )
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self.flush_ledger(sync=True)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.flush_ledger(sync=True)
        self.check_settings(args)  # a change after the last step would still reach the card written after train()
        return control

    def __repr__(self) -> str:
        eps = self.epsilon() if self.history and self.delta is not None else 0.0
        eps_text = "inf" if math.isinf(eps) else f"{eps:.3f}"
        return (
            f"DPCallback(sigma={self.noise_multiplier}, q={self.sample_rate}, delta={self.delta}, steps={self.steps}, "
            f"epsilon={eps_text})"
        )
