"""``DPSeq2SeqTrainer``: ``Seq2SeqTrainer`` (generation in evaluation and prediction) with DP training."""

from __future__ import annotations

from transformers import Seq2SeqTrainer

from ..arguments import DPSeq2SeqTrainingArguments
from .mixin import DPTrainerMixin

__all__ = ["DPSeq2SeqTrainer"]


class DPSeq2SeqTrainer(DPTrainerMixin, Seq2SeqTrainer):
    """Drop-in replacement for :class:`~transformers.Seq2SeqTrainer` that trains with (epsilon, delta)-DP.

    Training is exactly :class:`DPTrainer`'s (one shared implementation); ``evaluate``/``predict`` are
    ``Seq2SeqTrainer``'s, so ``predict_with_generate``, ``generation_max_length``, ``generation_num_beams`` and
    ``generation_config`` behave as in transformers. A summarization or translation script changes three names:
    ``Seq2SeqTrainingArguments`` -> :class:`DPSeq2SeqTrainingArguments`, ``Seq2SeqTrainer`` -> ``DPSeq2SeqTrainer``,
    and the import.

    Example:
        ```python
        args = DPSeq2SeqTrainingArguments(output_dir="out", target_epsilon=3.0, predict_with_generate=True,
                                          per_device_train_batch_size=16, gradient_accumulation_steps=16)
        trainer = DPSeq2SeqTrainer(model=t5, args=args, train_dataset=train, eval_dataset=dev,
                                   data_collator=DataCollatorForSeq2Seq(tokenizer, model=t5))
        trainer.train()
        trainer.predict(test, max_length=64, num_beams=4)
        ```
    """

    _dp_arguments_class = DPSeq2SeqTrainingArguments
