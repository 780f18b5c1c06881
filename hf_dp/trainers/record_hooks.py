"""The Trainer hooks of the privacy record: the run's :class:`~hf_dp.DPCallback` (accountant, ledger, budget stop),
set from the frozen plan; the privacy spent restored when resuming (:mod:`hf_dp.ledger.resume`); epsilon in every
log."""

from __future__ import annotations

import copy
import math
import os

import torch

from ..ledger.callback import DPCallback
from ..ledger.earlier_runs import account_earlier_runs, earlier_runs
from ..ledger.fingerprint import data_fingerprint, fingerprint_key
from ..ledger.ledger import LEDGER_NAME, PrivacyLedger, new_run_id, read_ledger
from ..ledger.resume import checkpoint_to_resume, restore_privacy_spent
from ..step.distributed import broadcast_from_main

__all__ = ["PrivacyRecordHooks"]


class _CurrentCallback:
    """The DP step's privacy record (:class:`~hf_dp.step.dp_step.PrivacyRecord`): the trainer's DPCallback at the
    time of each call, looked up (restoring callback states from a checkpoint replaces the instance)."""

    def __init__(self, trainer) -> None:
        self._trainer = trainer

    @property
    def steps(self) -> int:
        return self._trainer.dp_callback.steps

    def record_step(self, *, noise_multiplier: float, sample_rate: float, max_grad_norm: float) -> None:
        self._trainer.dp_callback.record_step(
            noise_multiplier=noise_multiplier, sample_rate=sample_rate, max_grad_norm=max_grad_norm
        )

    def record_clip_norm(self, used: float, next_clip_norm: float) -> None:
        self._trainer.dp_callback.record_clip_norm(used, next_clip_norm)


class PrivacyRecordHooks:
    """``dp_callback``, ``epsilon()``, ``log`` and the resume of a DP trainer (part of
    :class:`~hf_dp.trainers.mixin.DPTrainerMixin`)."""

    @property
    def dp_callback(self) -> DPCallback:
        """The run's DPCallback (looked up: restoring callback states from a checkpoint replaces the instance)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, DPCallback):
                return callback
        raise RuntimeError("The DPCallback was removed from this trainer; it holds the privacy accountant.")

    def _configure_dp_callback(self) -> None:
        """The callback's settings from the frozen plan (the arguments are checked against it at every step); inside
        ``train()`` (once the training set is fingerprinted), the run's identity and its privacy ledger (written by the
        main process only)."""
        plan, callback = self.dp_plan, self.dp_callback
        fingerprint = getattr(self, "_data_fingerprint", None)
        if callback.run_id is None:
            callback.run_id = new_run_id()
        ledger = None
        if fingerprint is not None:
            callback.data_fingerprint = fingerprint
            if self.is_world_process_zero():
                ledger = self._open_ledger(callback, fingerprint)
        callback.configure(
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
            delta=plan.delta,
            accountant=plan.accountant,
            epsilon_budget=plan.target_epsilon,
            num_examples=plan.num_examples,
            frozen_plan=plan,
            ledger=ledger,
            bands=plan.noise_bands,
        )
        callback.plan = plan.saved()

    def _open_ledger(self, callback: DPCallback, fingerprint) -> PrivacyLedger:
        """The run's ledger in ``output_dir``, continuing the run's chain there: from its last line, or (its lines
        lost, or behind the checkpoint resumed) from the run's own count and last hash."""
        plan, path = self.dp_plan, os.path.join(self.args.output_dir, LEDGER_NAME)
        settings = {
            "max_grad_norm": plan.max_grad_norm,
            "delta": plan.delta,
            "accountant": plan.accountant,
            "unit": plan.privacy_unit,
            "max_examples_per_user": plan.max_examples_per_user,
            "mechanism": plan.noise_mechanism,
            "bands": plan.noise_bands,
        }
        chain = read_ledger(path).get(callback.run_id)
        args = (self.args.output_dir, callback.run_id, fingerprint, settings)
        if chain is None or chain.steps < callback.steps:
            return PrivacyLedger(*args, base=(callback.steps, callback.ledger_head))
        if chain.steps > callback.steps or chain.head != callback.ledger_head:
            raise RuntimeError(
                f"hf_dp: the privacy ledger {path} records {chain.steps} noisy steps of this run, ending at another "
                f"line than the {callback.steps} steps the run took: it was edited or replaced since. Restore it (a "
                "checkpoint's dp_ledger.jsonl holds the run's lines up to it), or resume from a checkpoint."
            )
        return PrivacyLedger(*args, chain=chain)

    def _load_callback_state(self) -> None:
        """The Trainer's restore of callback states (``restore_callback_states_from_checkpoint``) rebuilds the
        DPCallback from the checkpoint; it keeps what ``train()`` resolved from it (the history: the larger of the
        checkpoint's and the ledger's; the draw offset; the run and data identity) and gets this run's settings,
        never the checkpoint's."""
        before = self.dp_callback
        super()._load_callback_state()
        after = self.dp_callback
        if after is not before:
            for name in DPCallback._SAVED:
                setattr(after, name, copy.deepcopy(getattr(before, name)))
        self._configure_dp_callback()

    def _privacy_record(self) -> _CurrentCallback:
        """Where the DP step records its noisy steps: the run's DPCallback, whichever instance it is at the time."""
        return _CurrentCallback(self)

    def epsilon(self, accountant: str | None = None) -> float:
        """Epsilon spent so far under ``accountant`` (default: ``args.accountant``)."""
        return self.dp_callback.epsilon(accountant or self.dp_plan.accountant)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds ``epsilon`` and ``epsilon_<accountant>`` to every log (so they reach log_history and reporters), and
        reports as ``loss`` the mean per-example loss of the examples actually used since the last log (a local,
        non-private diagnostic: never written to released files unless ``publish_training_metrics``)."""
        if "loss" in logs:
            total = self._reduce_loss(self._loss_window)
            self._loss_total += self._loss_window
            self._loss_window.zero_()
            # NaN when every batch since the last log was empty (Poisson batches can be)
            logs["loss"] = float(total[0] / total[1]) if total[1] > 0 else math.nan
        if "train_loss" in logs:
            total = self._reduce_loss(self._loss_total + self._loss_window)
            logs["train_loss"] = float(total[0] / total[1]) if total[1] > 0 else math.nan
        if self.dp_callback.delta is not None:
            callback, plan = self.dp_callback, self.dp_plan
            logs["epsilon"] = callback.epsilon(plan.accountant)
            for name in plan.epsilon_accountants:
                logs[f"epsilon_{name}"] = logs["epsilon"] if name == plan.accountant else callback.epsilon(name)
            if self.dp_step is not None and self.dp_step.adaptive is not None:  # the C of the next step (noised)
                logs["clip_norm"] = self.dp_step.adaptive.clip_norm
        super().log(logs, start_time)

    def _reduce_loss(self, window: torch.Tensor) -> torch.Tensor:
        reduced = window.clone()
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(reduced)
        return reduced.cpu()

    def _start_privacy_record(self, resume_from_checkpoint: str | bool | None) -> int:
        """Fingerprint the training set; when resuming, load the privacy spent from the checkpoint (reconciled with
        the ledger). Returns the checkpoint's global step (0 for a fresh start)."""
        callback = self.dp_callback
        key, self._fingerprint_key_new = broadcast_from_main(
            [fingerprint_key(self.args.output_dir) if self.is_world_process_zero() else None]
        )[0]
        self._data_fingerprint = data_fingerprint(self.train_dataset, key)  # checked on resume, written to the ledger
        if not resume_from_checkpoint:
            callback.draw_offset = callback.steps  # an earlier train() call used draws [0, steps): continue after it
            self._account_earlier_runs()
            return 0
        steps_done = restore_privacy_spent(
            callback,
            checkpoint_to_resume(resume_from_checkpoint, self.args.output_dir),
            output_dir=self.args.output_dir,
            fingerprint=self._data_fingerprint,
            fingerprint_key_is_new=self._fingerprint_key_new,
            privacy_unit=self.args.privacy_unit,
            is_main_process=self.is_world_process_zero(),
        )
        if self.args.ignore_data_skip:  # the epoch restarts from its first batch: continue with fresh draws
            callback.draw_offset = callback.steps
        self._account_earlier_runs()
        return steps_done

    def _account_earlier_runs(self) -> None:
        """The noisy steps of the other runs ``output_dir``'s ledger records: counted as spent, or said not covered
        (``earlier_runs``; :mod:`hf_dp.ledger.earlier_runs`)."""
        callback = self.dp_callback
        known = {run["run"] for run in callback.carried}
        found = earlier_runs(self.args.output_dir, callback.run_id, known) if self.is_world_process_zero() else []
        chains = broadcast_from_main([found])[0]
        carried, notes = account_earlier_runs(
            chains,
            policy=self.args.earlier_runs,
            privacy_unit=self.args.privacy_unit,
            fingerprint=self._data_fingerprint,
        )
        callback.carried.extend(carried)
        callback.not_covered.extend(n for n in notes if n not in callback.not_covered)
