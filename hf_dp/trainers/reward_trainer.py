"""DP reward modelling for TRL: :class:`DPRewardTrainer` / :class:`DPRewardConfig` (outcome reward models).

TRL's ``reward_modeling.py`` changes three names: ``RewardConfig`` -> ``DPRewardConfig``, ``RewardTrainer`` ->
``DPRewardTrainer`` and the import. The dataset formats (standard and conversational ``chosen``/``rejected``, with an
explicit or implicit prompt, an optional ``margin`` column), the tokenisation, the collator, ``peft_config`` and
evaluation are TRL's.

The unit of privacy is one preference pair, or with ``privacy_unit="user"`` every pair of one user. TRL's collator
puts a micro-batch's ``B`` chosen sequences, then its ``B`` rejected ones, into one ``[2B, T]`` batch and scores them in
one forward pass; a DP step arranges the batch as ``B`` pairs ``[B, 2, T]`` and runs the reward model twice (the
chosen rows, then the rejected rows: both passes book-kept), so that the loss of pair ``i`` depends on pair ``i`` alone:

    loss_i = -log sigmoid(r(c_i) - r(r_i) - margin_i) + center_rewards_coefficient * (r(c_i) + r(r_i))^2

(the margin and the centering term only when the dataset has a ``margin`` column, and the coefficient is set). TRL's
batch loss is the mean of these.

This module imports TRL; ``import hf_dp`` does not. Install it with ``pip install 'hf_dp[trl]'``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..sampling.collators import is_empty_batch
from ..sampling.privacy_unit import UNIT_KEY
from .mixin import DPTrainerMixin
from .reward_config import DPRewardConfig, check_reward_fields
from .trl_common import RewardTrainer, pair_card_section, prepare_trl_init, quiet_model_init_kwargs_warning

__all__ = ["DPRewardTrainer"]

#: The batch keys TRL's reward collator returns with ``2B`` rows (chosen rows first, then rejected rows).
_ROW_KEYS = ("input_ids", "attention_mask")


class DPRewardTrainer(DPTrainerMixin, RewardTrainer):
    """Drop-in replacement for TRL's :class:`~trl.RewardTrainer` that trains a reward model with (epsilon,
    delta)-differential privacy, the unit of privacy being one preference pair (or every pair of one user, with
    ``privacy_unit="user"``).

    Takes RewardTrainer's arguments (``model`` as a Hub id, a local path or a sequence classification model with
    ``num_labels=1``; ``peft_config``; ``quantization_config``; ...) with ``args`` a :class:`DPRewardConfig`.

    In a DP step the reward model runs twice per micro-batch, on the ``B`` chosen sequences and on the ``B`` rejected
    ones (both passes book-kept: the per-pair gradient norm includes the cross terms between them), and the loss of
    pair ``i`` is ``-log sigmoid(r_chosen_i - r_rejected_i)`` (minus the pair's ``margin`` inside the sigmoid when the
    dataset has one, plus ``center_rewards_coefficient * (r_chosen_i + r_rejected_i)^2`` when it is set), computed in
    at least float32; never a batch mean.

    TRL's training metrics (``min_reward``, ``mean_reward``, ``max_reward``, ``accuracy``, ``margin``,
    ``num_tokens``) are un-noised statistics of the training pairs: they are not computed in DP steps. Evaluation is
    TRL's (``eval_loss`` and the ``eval_*`` reward metrics).

    Raises:
        ValueError: before training, for any setting that would break the guarantee.

    Example:
        ```python
        from hf_dp import DPRewardConfig, DPRewardTrainer   # was: from trl import RewardConfig, RewardTrainer

        args = DPRewardConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=1.0,
                              per_device_train_batch_size=8, gradient_accumulation_steps=32, learning_rate=1e-4)
        trainer = DPRewardTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", args=args, train_dataset=pairs,
                                  peft_config=LoraConfig(r=16, task_type="SEQ_CLS", target_modules="all-linear"))
        trainer.train()
        ```
    """

    _dp_arguments_class = DPRewardConfig

    def __init__(
        self,
        model: Any,
        args: DPRewardConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics: Callable | None = None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics: Callable | None = None,
        quantization_config=None,
        peft_config=None,
    ):
        from transformers import AutoModelForSequenceClassification
        from trl.trainer import reward_trainer

        with reward_trainer.suppress_seqcls_warning():  # the new score head, as TRL loads it
            args, model, processing_class, quantization_config, loaded_from = prepare_trl_init(
                "DPRewardTrainer",
                DPRewardConfig,
                check_reward_fields,
                args,
                model,
                train_dataset,
                quantization_config,
                processing_class,
                architecture=AutoModelForSequenceClassification,
                init_overrides={"num_labels": 1},  # the reward: one score per sequence
                router_aux_loss=False,  # TRL's reward loss reads the scores only
            )
        with quiet_model_init_kwargs_warning(loaded_from is not None, reward_trainer):
            super().__init__(
                model=model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                compute_metrics=compute_metrics,
                callbacks=callbacks,
                optimizers=optimizers,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                quantization_config=quantization_config,
                peft_config=peft_config,
            )

    # ------------------------------------------------------------------ batch
    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The micro-batch as ``B`` pairs (``[B, 2, T]``), then hf_dp's DP step."""
        if self._in_train and not is_empty_batch(inputs):
            inputs = self._pair_batch(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def _pair_batch(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """TRL's ``[2B, T]`` batch (chosen rows, then rejected rows) as ``[B, 2, T]`` pairs; ``margin`` stays
        ``[B]``."""
        if "input_ids" not in inputs or "attention_mask" not in inputs:
            raise ValueError(
                "DPRewardTrainer expects the batches of TRL's reward collator (`input_ids`, `attention_mask`, "
                f"optionally `margin`), got keys {sorted(inputs)}."
            )
        rows = inputs["input_ids"].shape[0]
        if rows % 2:
            raise ValueError(f"A preference batch has chosen and rejected rows (an even number), got {rows}.")
        batch = dict(inputs)
        units = batch.pop(UNIT_KEY, None)  # privacy_unit="user": one user code per pair, kept on the host
        for key, value in list(batch.items()):
            if key in _ROW_KEYS:
                batch[key] = torch.stack(value.chunk(2, dim=0), dim=1)  # [B, 2, T]: pair i's chosen and rejected rows
            elif key != "margin" and isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ValueError(
                    f"DPRewardTrainer does not know how to split the batch key {key!r} (shape {tuple(value.shape)}) "
                    "into preference pairs; use TRL's reward collator (`DataCollatorForPreference`)."
                )
        if units is not None:
            batch[UNIT_KEY] = units
        return batch

    # ------------------------------------------------------------------ loss
    def dp_forward(self, model, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The rewards ``[B]`` of each pair's chosen and rejected sequences, from two forward passes of ``B`` rows
        (``inputs`` as ``[B, 2, T]``)."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        rewards = []
        for j in (0, 1):  # chosen, rejected
            outputs = model(input_ids=input_ids[:, j], attention_mask=attention_mask[:, j], use_cache=False)
            logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
            rewards.append(logits[:, 0])  # num_labels=1: one score per sequence
        return {"chosen": rewards[0], "rejected": rewards[1]}

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]``: TRL's reward loss of each pair alone (the margin and centering terms per pair)."""
        chosen, rejected = outputs["chosen"], outputs["rejected"]
        dtype = torch.promote_types(chosen.dtype, torch.float32)
        chosen, rejected = chosen.to(dtype), rejected.to(dtype)
        difference = chosen - rejected
        if "margin" in inputs:
            difference = difference - inputs["margin"].to(difference)
        loss = -F.logsigmoid(difference)
        coefficient = self.args.center_rewards_coefficient
        if coefficient is not None:
            # TRL: coefficient * mean over the batch of (r_c + r_r)^2; per pair, that pair's term
            loss = loss + coefficient * (chosen + rejected) ** 2
        return loss

    # ------------------------------------------------------------------ card
    def dp_model_card_section(self, epsilon_plot: str | None = None) -> str:
        """The DP section, whose unit line says the unit is one preference pair."""
        return pair_card_section(super().dp_model_card_section(epsilon_plot=epsilon_plot))
