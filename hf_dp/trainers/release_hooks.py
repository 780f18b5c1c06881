"""The Trainer hooks of release: everything a DP trainer writes or pushes goes through :mod:`hf_dp.release` (the
released state and metrics, the DP model card in every folder that receives weights, the audit record)."""

from __future__ import annotations

import logging

from ..release import publisher
from ..release.eval_overlap import withheld_metric_prefixes
from ..release.filter import release_state, released_metrics

logger = logging.getLogger("hf_dp")

__all__ = ["ReleaseHooks"]


class ReleaseHooks:
    """``save_metrics``, ``save_state``, ``create_model_card``, ``save_model``, the hub uploads and the card section of
    a DP trainer (part of :class:`~hf_dp.trainers.mixin.DPTrainerMixin`)."""

    def save_metrics(self, split, metrics, combined=True):
        """``Trainer.save_metrics`` without un-noised training statistics (see :mod:`hf_dp.release.filter`)."""
        kept = released_metrics(metrics, self.args.publish_training_metrics, withheld_metric_prefixes(self))
        return super().save_metrics(split, kept, combined)

    def save_state(self):
        """``Trainer.save_state``; the written ``trainer_state.json`` holds only released statistics."""
        release_state(self.state, self.args.publish_training_metrics, withheld_metric_prefixes(self))
        return super().save_state()

    def create_model_card(self, *args, **kwargs) -> None:
        """``Trainer.create_model_card`` from the released log history only, plus the DP section and its tags."""
        publisher.create_released_model_card(self, super().create_model_card, *args, **kwargs)
        if self.is_world_process_zero():
            publisher.write_dp_card(self, self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (the plain model or PEFT adapter, never a wrapper) plus the DP model card of this
        moment, in every folder that receives weights (checkpoints too: they are uploaded under ``hub_strategy``)."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.is_world_process_zero():
            # the run's ledger lines travel with the weights (a checkpoint knows its history wherever it is copied)
            self.dp_callback.write_ledger_copy(output_dir or self.args.output_dir)
            publisher.write_dp_card(self, output_dir or self.args.output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """``Trainer._push_from_checkpoint`` (``hub_strategy`` every_save, checkpoint, all_checkpoints), with the DP
        card of this moment in both uploaded folders: the checkpoint's (written by ``save_model``) and ``output_dir``,
        into which the Trainer copies the checkpoint's weights. Written only when the Trainer does upload (not while an
        earlier upload of ``output_dir`` is still running), so the card always goes with the weights it describes."""
        from transformers.trainer_utils import HubStrategy

        in_progress = getattr(self, "push_in_progress", None)
        if (
            self.is_world_process_zero()
            and self.args.hub_strategy != HubStrategy.END
            and (self.args.hub_always_push or in_progress is None or in_progress.is_done())
        ):
            publisher.write_dp_card(self, self.args.output_dir)
        super()._push_from_checkpoint(checkpoint_folder)

    def _release_after_train(self) -> None:
        """The card in ``output_dir`` and on the model's own saves, at the end of ``train()`` (main process; a failure
        here is logged, never raised over the error that ended training)."""
        if not self.is_world_process_zero():
            return
        try:
            publisher.release_after_train(self)
        except Exception as error:  # noqa: BLE001
            logger.warning("hf_dp: could not write the DP model card at the end of train(): %s", error)

    def dp_model_card_section(self, epsilon_plot: str | None = None) -> str:
        """The "Differential privacy" section of the model card, for the privacy spent so far."""
        if self.dp_callback.delta is None:  # no train() yet: the card states the plan and zero steps
            self._configure_dp_callback()
        return publisher.dp_card_section(self, epsilon_plot=epsilon_plot)

    def record_audit(self, result) -> None:
        """Carry a privacy audit's result (``hf_dp.audit``; an object with ``card_fields()`` or a dict) on the card."""
        self.dp_audit_result = dict(result.card_fields() if hasattr(result, "card_fields") else result)
