"""`AuditCallback`: scores the canaries when training starts and when it ends, through the Trainer's callback events.

It works with any `transformers.Trainer` (plain or `DPTrainer`) and touches nothing but the model it is handed: it
scores in eval mode under ``torch.no_grad`` and puts the model back in the mode it found it in. It holds the
canaries and their losses, never the inclusion bits (those stay with `CanaryAudit`).
"""

from __future__ import annotations

from transformers import TrainerCallback

from .scores import CanaryScores

__all__ = ["AuditCallback"]


class AuditCallback(TrainerCallback):
    """Records the canaries' losses under the initial model (``on_train_begin``) and the trained one
    (``on_train_end``), and their exposure if asked.

    Create it with `CanaryAudit.callback`.

    Args:
        scores (`CanaryScores`): where the losses go.

    Raises:
        RuntimeError: at ``on_train_begin`` of a resumed run (``global_step > 0``) whose initial losses were not
            recorded: the model is no longer the initial one.
    """

    def __init__(self, scores: CanaryScores) -> None:
        self.scores = scores

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.scores.initial_losses is not None:
            return
        if state.global_step > 0:
            raise RuntimeError(
                f"The audit callback starts at step {state.global_step} (a resumed run), so the model is not the "
                "initial one and the canaries' initial losses are unknown. Score the initial model with "
                "`audit.score_initial(model)` before the first training run, or audit a run without resuming."
            )
        if model is None:
            raise RuntimeError("The Trainer passed no model to `on_train_begin`; call `audit.score_initial(model)`.")
        self.scores.record_initial(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("The Trainer passed no model to `on_train_end`; call `audit.score_final(model)`.")
        self.scores.record_final(model)
