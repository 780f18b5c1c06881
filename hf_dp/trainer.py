"""``DPTrainer``: the Hugging Face ``Trainer`` with differentially private training.

What changes against ``Trainer`` (DESIGN §3): the training DataLoader draws Poisson logical batches; the loss is one
loss per example; the backward is book-kept so that ``p.grad`` receives the sum of clipped per-example gradients;
Gaussian noise is added once per logical step (before the Trainer reads ``grad_norm``); epsilon is logged; a
``DPCallback`` holds the accountant and the noise generator, and checkpoints carry them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint, seed_worker
from transformers.utils import is_datasets_available

from .accounting import noise_multiplier as calibrate_noise_multiplier
from .arguments import DPTrainingArguments
from .callback import DPCallback
from .checks import check_before_init, dp_arguments
from .collators import EmptyBatchSafeCollator, is_empty_batch
from .distributed import all_reduce_sum_
from .engine import BookKeepingClipper
from .losses import PER_EXAMPLE_LOSSES, infer_loss_type
from .model_card import DP_TAGS, DPModelCardData, render_dp_section, write_dp_model_card
from .sampler import PoissonBatchSampler

logger = logging.getLogger(__name__)

__all__ = ["DPTrainer"]

TRAINER_STATE_NAME = "trainer_state.json"


class DPTrainer(Trainer):
    """Drop-in replacement for :class:`~transformers.Trainer` that trains with (epsilon, delta)-differential privacy.

    Takes the same arguments as ``Trainer``; the DP settings are in ``args`` (:class:`DPTrainingArguments`; a plain
    ``TrainingArguments`` is converted and then needs `target_epsilon` or `noise_multiplier`, so pass
    ``DPTrainingArguments``). ``compute_loss_func``, if given, is called as ``compute_loss_func(outputs, labels)`` and
    must return one loss per example (shape ``[B]``).

    Raises:
        ValueError: before training, for any setting that would break the guarantee (see the README).

    Example:
        ```python
        args = DPTrainingArguments(output_dir="out", target_epsilon=3.0, per_sample_max_grad_norm=0.1,
                                   per_device_train_batch_size=32, gradient_accumulation_steps=32)
        trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
        trainer.train()
        trainer.push_to_hub()
        ```
    """

    _tag_names = DP_TAGS
    loss_is_scaled_for_ga = True  # compute_loss returns sum_i loss_i / L: nothing to divide by accumulation

    def __init__(
        self,
        model: nn.Module | None = None,
        args: DPTrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
    ) -> None:
        args = dp_arguments(args)
        check_before_init(model, args, train_dataset, model_init)
        num_examples = len(train_dataset)
        world_size = args.world_size
        self.expected_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
        self.sample_rate = self.expected_batch_size / num_examples
        if self.sample_rate > 1:
            raise ValueError(
                f"The expected logical batch ({self.expected_batch_size} = per_device_train_batch_size x "
                f"gradient_accumulation_steps x world_size) is larger than the training set ({num_examples}). Lower "
                "`per_device_train_batch_size` or `gradient_accumulation_steps`."
            )
        self.delta = args.target_delta if args.target_delta is not None else 1 / (2 * num_examples)
        if self.delta >= 1 / num_examples:
            logger.warning(
                "target_delta=%g >= 1/N=%g: a mechanism that publishes one random example meets this delta. "
                "Use delta well below 1/N (the default is 1/(2N)).",
                self.delta,
                1 / num_examples,
            )
        if args.max_steps is None or args.max_steps <= 0:
            args.max_steps = math.ceil(args.num_train_epochs / self.sample_rate)
        self.num_dp_steps = args.max_steps
        if args.target_epsilon is not None:
            sigma = calibrate_noise_multiplier(
                args.target_epsilon, self.delta, self.sample_rate, self.num_dp_steps, accountant=args.accountant
            )
            logger.info(
                "Calibrated noise multiplier %.4f for epsilon=%s, delta=%g, q=%.4g, %d steps (%s).",
                sigma,
                args.target_epsilon,
                self.delta,
                self.sample_rate,
                self.num_dp_steps,
                args.accountant,
            )
        else:
            sigma = args.noise_multiplier
        self.dp_noise_multiplier = float(sigma)
        self.num_train_examples = num_examples
        dp_callback = DPCallback(
            noise_multiplier=self.dp_noise_multiplier,
            sample_rate=self.sample_rate,
            delta=self.delta,
            accountant=args.accountant,
            epsilon_budget=args.target_epsilon,
            noise_seed=args.noise_seed,
        )
        callbacks = [*(callbacks or []), dp_callback]
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=None,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.model_accepts_loss_kwargs = False  # never pass num_items_in_batch: it couples examples
        self.loss_type = args.loss_type if args.loss_type != "auto" or compute_loss_func else infer_loss_type(model)
        self.clipper = BookKeepingClipper(
            self.model, max_grad_norm=args.per_sample_max_grad_norm, mode=args.clipping_mode
        )
        self._dp_step_active = False
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """Poisson logical batches split into ``gradient_accumulation_steps`` micro-batches (may be empty)."""
        if not self.args.poisson_sampling:
            return super().get_train_dataloader()
        dataset, collator = self.train_dataset, self.data_collator
        lengths = None
        if self.args.train_sampling_strategy == "group_by_length":
            # Trainer's own LengthGroupedSampler resolves the lengths (length column, or the first model input).
            lengths = super()._get_train_sampler(dataset).lengths
        if is_datasets_available():
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="Training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="Training")
        sampler = PoissonBatchSampler(
            len(dataset),
            self.sample_rate,
            self.args.gradient_accumulation_steps,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            num_replicas=self.args.world_size,
            rank=self.args.process_index,
            lengths=lengths,
        )
        params: dict[str, Any] = {
            "batch_sampler": sampler,
            "collate_fn": EmptyBatchSafeCollator(collator),
            "num_workers": self.args.dataloader_num_workers,
            "pin_memory": self.args.dataloader_pin_memory,
            "persistent_workers": self.args.dataloader_persistent_workers,
            "worker_init_fn": partial(
                seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
            ),
        }
        if self.args.dataloader_num_workers > 0 and self.args.dataloader_prefetch_factor is not None:
            params["prefetch_factor"] = self.args.dataloader_prefetch_factor
        dataloader = self.accelerator.prepare(DataLoader(dataset, **params))
        # The sampler is already rank-aware: make accelerate's re-sharding wrapper (if any) a passthrough.
        wrapper = getattr(dataloader, "batch_sampler", None)
        if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes, wrapper.process_index = 1, 0
        return dataloader

    # ------------------------------------------------------------------ loss and step
    def _per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(
                "DPTrainer needs `labels` in every batch to compute one loss per example (e.g. use "
                "DataCollatorForLanguageModeling for causal LM)."
            )
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels)
        else:
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            if self.loss_type == "causal_lm" and "shift_labels" in inputs:
                loss = PER_EXAMPLE_LOSSES["token_classification"](
                    logits, inputs["shift_labels"], reduction=self.args.per_example_loss_reduction
                )
            else:
                loss = PER_EXAMPLE_LOSSES[self.loss_type](
                    logits, labels, reduction=self.args.per_example_loss_reduction
                )
        if loss.dim() != 1 or loss.shape[0] != labels.shape[0]:
            raise ValueError(
                f"The per-example loss must have shape [{labels.shape[0]}], got {tuple(loss.shape)}; "
                "`compute_loss_func` must not average over the batch."
            )
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """One loss per example from logits and labels; never the model's batch-mean loss."""
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        unwrapped = self.accelerator.unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" not in model_inputs:
            model_inputs["decoder_input_ids"] = unwrapped.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
        outputs = model(**model_inputs)
        per_example = self._per_example_loss(outputs, inputs)
        if self._dp_step_active:
            self.clipper.prepare(per_example)
            loss = per_example.sum() / self.expected_batch_size
        else:  # evaluation: the usual mean
            loss = per_example.mean()
        return (loss, outputs) if return_outputs else loss

    def _loss_scale(self) -> float:
        """``w``: the factor between the true per-example gradients and those the backward produced (K / L)."""
        scaler = getattr(self.accelerator, "scaler", None)
        k = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        accumulation = getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1
        return k / (self.expected_batch_size * accumulation)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Clipped per-example gradients into ``p.grad``; at the last micro-batch, the noise."""
        scale = self._loss_scale()
        if is_empty_batch(inputs):  # a Poisson batch can be empty: no gradient, but the step still counts
            loss = torch.zeros((), device=self.args.device)
        else:
            self._dp_step_active = True
            # DDP must not reduce: BK puts the clipped sums in p.grad outside autograd, and they are all-reduced
            # once per logical step below (ranks with an empty micro-batch skip the backward without deadlock).
            no_sync = model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()
            try:
                with no_sync:
                    loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._dp_step_active = False
            # The backward ran on w * sum_i loss_i: clip at w*C in its units (Li et al. 2022, App. T: K*C in fp16).
            self.clipper.finish(loss_scale=scale)
        if self.accelerator.sync_gradients:
            # Noise once per logical step: the main process adds N(0, sigma^2 C^2) to its share of the sum before
            # the all-reduce, so the global sum carries it exactly once.
            if self.accelerator.is_main_process:
                self._add_noise(scale)
            else:
                self._ensure_grads()
            if self.accelerator.num_processes > 1:
                self._all_reduce_grads()
        return loss

    def _trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.clipper.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def _ensure_grads(self) -> None:
        for p in self._trainable_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    @torch.no_grad()
    def _all_reduce_grads(self) -> None:
        all_reduce_sum_([p.grad for p in self._trainable_parameters()])

    @torch.no_grad()
    def _add_noise(self, scale: float) -> None:
        """p.grad = w * (sum_i clip(g_i) + N(0, sigma^2 C^2)), so that after unscaling by K it is the DP-SGD update
        (sum + noise) / L, noise drawn once per logical step from the checkpointed generator."""
        std = scale * self.dp_noise_multiplier * self.args.per_sample_max_grad_norm
        callback = self.dp_callback
        for p in self._trainable_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if std > 0:
                generator = callback.noise_generator(p.device)
                noise = torch.normal(0.0, std, p.shape, generator=generator, device=p.device, dtype=torch.float32)
                p.grad.add_(noise.to(p.grad.dtype))

    # ------------------------------------------------------------------ privacy state, logs, resume
    @property
    def dp_callback(self) -> DPCallback:
        """The run's DPCallback (looked up: restoring callback states from a checkpoint replaces the instance)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, DPCallback):
                return callback
        raise RuntimeError("The DPCallback was removed from this DPTrainer; it holds the privacy accountant.")

    def epsilon(self, accountant: str | None = None) -> float:
        """Epsilon spent so far under ``accountant`` (default: ``args.accountant``)."""
        return self.dp_callback.epsilon(accountant or self.args.accountant)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds ``epsilon`` and ``epsilon_<accountant>`` to every log (so they reach log_history and reporters)."""
        callback = self.dp_callback
        logs["epsilon"] = callback.epsilon(self.args.accountant)
        for name in self.args.epsilon_accountants:
            logs[f"epsilon_{name}"] = logs["epsilon"] if name == self.args.accountant else callback.epsilon(name)
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``; on resume, the privacy spent so far and the noise generator are restored first."""
        if resume_from_checkpoint:
            checkpoint = resume_from_checkpoint
            if checkpoint is True:
                checkpoint = get_last_checkpoint(self.args.output_dir)
                if checkpoint is None:
                    raise ValueError(f"No checkpoint found in output_dir ({self.args.output_dir}) to resume from.")
            self._restore_dp_state(checkpoint)
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )

    def _restore_dp_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, TRAINER_STATE_NAME)
        with open(path, encoding="utf-8") as f:
            stateful = json.load(f).get("stateful_callbacks", {})
        state = stateful.get(DPCallback.__name__)
        if isinstance(state, list):
            state = state[0]
        if state is None:
            raise ValueError(
                f"Checkpoint {checkpoint} has no DPCallback state, so the privacy already spent is unknown. Resume "
                "only from checkpoints written by DPTrainer."
            )
        self.dp_callback.load_state(state)
        logger.info("Restored DP state from %s: %r", checkpoint, self.dp_callback)

    # ------------------------------------------------------------------ release
    def dp_model_card_section(self) -> str:
        """The "Differential privacy" section of the model card, for the privacy spent so far."""
        callback = self.dp_callback
        names = sorted({self.args.accountant, *self.args.epsilon_accountants})
        optimizer = type(self.optimizer).__name__ if self.optimizer is not None else self.args.optim
        return render_dp_section(
            DPModelCardData(
                epsilons={name: callback.epsilon(name) for name in names},
                accountant=self.args.accountant,
                delta=self.delta,
                noise_multiplier=self.dp_noise_multiplier,
                sample_rate=self.sample_rate,
                steps=callback.steps,
                expected_batch_size=self.expected_batch_size,
                num_examples=self.num_train_examples,
                max_grad_norm=self.args.per_sample_max_grad_norm,
                clipping_mode=self.args.clipping_mode,
                poisson_sampling=self.args.poisson_sampling,
                optimizer=optimizer,
            )
        )

    def create_model_card(
        self,
        language=None,
        license=None,
        tags=None,
        model_name=None,
        finetuned_from=None,
        tasks=None,
        dataset_tags=None,
        dataset=None,
        dataset_args=None,
    ) -> None:
        """``Trainer.create_model_card`` plus the DP section and the ``differential-privacy``/``hf-dp`` tags."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [t for t in DP_TAGS if t not in tags]
        super().create_model_card(
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset_tags=dataset_tags,
            dataset=dataset,
            dataset_args=dataset_args,
        )
        if self.is_world_process_zero():
            self._write_dp_section(self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (the plain model or PEFT adapter, never a wrapper) plus the DP model card."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if not _internal_call and self.is_world_process_zero():
            self._write_dp_section(output_dir or self.args.output_dir)

    def _write_dp_section(self, output_dir: str) -> None:
        write_dp_model_card(output_dir, self.dp_model_card_section())
