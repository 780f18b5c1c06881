"""``DPTrainer``: the Hugging Face ``Trainer`` with differentially private training."""

from __future__ import annotations

from transformers import Trainer

from ..arguments import DPTrainingArguments
from .mixin import DPTrainerMixin

__all__ = ["DPTrainer"]


class DPTrainer(DPTrainerMixin, Trainer):
    """Drop-in replacement for :class:`~transformers.Trainer` that trains with (epsilon, delta)-differential privacy.

    Takes the same arguments as ``Trainer``; the DP settings are in ``args`` (:class:`DPTrainingArguments`).
    ``train_dataset`` may be omitted for ``evaluate()``/``predict()`` only. ``compute_loss_func``, if given, is
    called as ``compute_loss_func(outputs, labels)`` and must return one loss per example (shape ``[B]``); ``labels``
    is the batch's label tensor, or a dict of them when the batch carries several (``label_names``).

    Raises:
        ValueError: before training, for any setting that would break the guarantee (see docs/).

    Example:
        ```python
        args = DPTrainingArguments(output_dir="out", target_epsilon=3.0, per_sample_max_grad_norm=0.1,
                                   per_device_train_batch_size=32, gradient_accumulation_steps=32)
        trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
        trainer.train()
        trainer.push_to_hub()
        ```
    """

    _dp_arguments_class = DPTrainingArguments
