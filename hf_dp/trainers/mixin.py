"""``DPTrainerMixin``: the DP steps shared by every DP trainer (sampling, per-example loss, clipping, noise,
accounting, release), on top of a transformers ``Trainer`` class.

What changes against the Trainer (DESIGN §3): the training DataLoader draws Poisson logical batches from a secret
seed; the loss is one loss per example; the backward is book-kept, so that ``p.grad`` receives the sum of clipped
per-example gradients; Gaussian noise from a secret, per-start seed is added once per logical step (before the Trainer
reads ``grad_norm``) and the step is recorded with the sigma and q it used; epsilon is logged; everything written to
disk or pushed passes :mod:`hf_dp.release.filter`. The privacy settings are resolved when ``train()`` starts, from the
arguments, the data and the privacy already spent (:mod:`hf_dp.plan.privacy_plan`), never by editing the arguments. The
book-keeping hooks live only while ``train()`` runs; afterwards the model is a plain model again.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import secrets
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, seed_worker
from transformers.utils import is_datasets_available

from ..arguments import DPArgumentsMixin, DPTrainingArguments
from ..engine import BookKeepingClipper
from ..ledger.callback import DPCallback
from ..ledger.ledger import (
    KEY_NAME,
    LEDGER_NAME,
    PrivacyLedger,
    check_checkpoint_dp_state,
    data_fingerprint,
    fingerprint_key,
    history_steps,
    ledger_history,
    new_run_id,
)
from ..losses import LABEL_NAMES, infer_loss_type, per_example_loss
from ..plan.checks import check_before_init, check_train_dataset, check_train_start, dp_arguments
from ..plan.privacy_plan import DPPlan, resolve_plan
from ..release.epsilon_plot import plot_epsilon_curve
from ..release.eval_overlap import check_eval_selection, eval_card_fields
from ..release.filter import release_state, released_log_history, released_metrics, unreleased_log_keys
from ..release.model_card import DPModelCardData, card_tags, render_dp_section, write_dp_model_card
from ..sampling.batch_checks import NUM_EXAMPLES_KEY, MicroBatchChecks
from ..sampling.collators import PLACEHOLDER_KEY, EmptyBatchSafeCollator, is_empty_batch
from ..sampling.poisson import PoissonBatchSampler
from ..sampling.privacy_unit import UNIT_KEY, UnitTaggedDataset, user_codes
from ..sampling.users import PoissonUserBatchSampler
from ..step.adaptive_state import AdaptiveClippingState
from ..step.distributed import all_reduce_sum_, any_process, broadcast_from_main
from ..step.fsdp import FSDP2Clipping, local_tensor
from ..step.loss_scale import NoisedOverflowScalePolicy
from ..step.noise import NoiseSource

logger = logging.getLogger("hf_dp")

__all__ = ["DPTrainerMixin"]

TRAINER_STATE_NAME = "trainer_state.json"
#: The epsilon-vs-step plot written next to the model card (when matplotlib is installed).
EPSILON_PLOT = "epsilon.png"


class DPTrainerMixin:
    """The DP core of :class:`~hf_dp.DPTrainer` and :class:`~hf_dp.DPSeq2SeqTrainer` (use those)."""

    # No `_tag_names`: TRL's trainers tag the model with it at init; the DP tags go only where the DP card is written.
    #: The arguments class this trainer takes.
    _dp_arguments_class: type = DPTrainingArguments
    loss_is_scaled_for_ga = True  # compute_loss returns sum_i loss_i / L: nothing to divide by accumulation

    def __init__(
        self,
        model: nn.Module | None = None,
        args: DPArgumentsMixin | None = None,
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
        args = dp_arguments(args, self._dp_arguments_class)
        check_before_init(
            model,
            args,
            train_dataset,
            model_init,
            data_collator=data_collator,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
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
            callbacks=[*(callbacks or []), DPCallback()],
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        if optimizer_cls_and_kwargs is not None:  # set here: Seq2SeqTrainer.__init__ does not take it
            if self.optimizer is not None:
                raise RuntimeError(
                    "Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible."
                )
            self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.loss_type = (
            args.dp_loss_type if args.dp_loss_type != "auto" or compute_loss_func else infer_loss_type(self.model)
        )
        self.clipper: BookKeepingClipper | None = None  # installed by train(), removed when it returns
        self.dp_audit_result: dict[str, Any] | None = None
        self._dp_plan: DPPlan | None = None
        self._noise_source: NoiseSource | None = None
        self._sampling_seed: int | None = None
        self._dp_step_active = False
        self._per_example_loss_seen = False
        self._needs_self_check = False
        self._batch_checks: MicroBatchChecks | None = None  # what reaches the model is what was sampled (train())
        self._sampled_examples: int | None = None  # examples the sampler put in the current micro-batch
        self._units = None  # privacy_unit="user": the user of each example of the current micro-batch (CPU codes)
        self._adaptive: AdaptiveClippingState | None = None  # adaptive clipping: C and the step's unclipped count
        self._in_train = False
        self._sharded: FSDP2Clipping | None = None  # FSDP2: set at the first step, on the sharded model
        self._loss_weight = 1.0  # 0 for the placeholder an FSDP2 rank runs for its empty micro-batch
        self._deferred_error: Exception | None = None  # FSDP2: a self-check error, raised with the other processes
        # [sum of per-example losses, examples] since the last log, and over this train() call; on the device, so that
        # accumulating them never waits for the device (read at logging steps only).
        self._loss_window = torch.zeros(2, device=self.args.device)
        self._loss_total = torch.zeros(2, device=self.args.device)
        release_state(self.state, args.publish_training_metrics)
        if train_dataset is not None:  # bad settings fail now, not after the model is loaded on every GPU
            self._dp_plan = self._resolve_plan()

    # ------------------------------------------------------------------ the plan
    def _resolve_plan(self, *, past=(), saved=None, steps_done: int = 0) -> DPPlan:
        num_rows = check_train_dataset(self.train_dataset)
        num_units = num_rows
        if self.args.privacy_unit == "user":
            num_units = self._user_codes(self.args.user_column)[1]
        return resolve_plan(
            self.args,
            num_units,
            world_size=self.args.world_size,
            past=past,
            saved=saved,
            steps_done=steps_done,
            num_rows=num_rows,
        )

    def _user_codes(self, column: str) -> tuple[np.ndarray, int]:
        """The user code of every training row and the number of users (``privacy_unit="user"``), read once per
        training set and column."""
        cached = getattr(self, "_user_codes_cache", None)
        if cached is None or cached[0] is not self.train_dataset or cached[1] != column:
            cached = (self.train_dataset, column, *user_codes(self.train_dataset, column))
            self._user_codes_cache = cached
        return cached[2], cached[3]

    @property
    def dp_plan(self) -> DPPlan:
        """The privacy settings of the current (or next) ``train()`` call."""
        if self._dp_plan is None:
            self._dp_plan = self._resolve_plan()
        return self._dp_plan

    # Read-only views of the plan, for scripts and reports.
    expected_batch_size = property(lambda self: self.dp_plan.expected_batch_size, doc="L, the expected logical batch.")
    sample_rate = property(lambda self: self.dp_plan.sample_rate, doc="q = L / N.")
    delta = property(lambda self: self.dp_plan.delta, doc="delta of the guarantee.")
    dp_noise_multiplier = property(lambda self: self.dp_plan.noise_multiplier, doc="sigma.")
    num_dp_steps = property(lambda self: self.dp_plan.num_steps, doc="Noisy steps in the schedule.")
    num_train_examples = property(lambda self: self.dp_plan.num_examples, doc="N.")

    def dp_summary(self) -> dict[str, Any]:
        """The privacy settings (what the WARNING line at ``train()`` start shows), plus epsilon spent so far."""
        plan = self.dp_plan
        return {
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "expected_batch_size": plan.expected_batch_size,
            "num_examples": plan.num_examples,
            "steps": plan.num_steps,
            "delta": plan.delta,
            "target_epsilon": plan.target_epsilon,
            "accountant": plan.accountant,
            "max_grad_norm": plan.max_grad_norm,
            "clipping_mode": plan.clipping_mode,
            "clipping_style": plan.clipping_style,
            "clipping_fn": plan.clipping_fn,
            "secure_mode": plan.secure_mode,
            "steps_taken": self.dp_callback.steps,
            "epsilon": self.dp_callback.epsilon(plan.accountant) if self.dp_callback.delta else 0.0,
        }

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """Poisson logical batches split into ``gradient_accumulation_steps`` micro-batches (may be empty)."""
        if not self.dp_plan.poisson_sampling:
            return super().get_train_dataloader()
        seed = self._sampling_seed
        if seed is None:  # outside train(): draws from a throwaway secret seed (never trained on)
            seed = self.args.seed if self.args.noise_seed is not None else secrets.randbits(128)
        dataset, collator = self.train_dataset, self.data_collator
        by_user = self.dp_plan.privacy_unit == "user"
        # the plan's column, read before the user column is removed
        codes = self._user_codes(self.dp_plan.user_column)[0] if by_user else None
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
        common = {
            "seed": seed,
            "draw_offset": self.dp_callback.draw_offset,
            "secure": self.dp_plan.secure_mode,
            "num_replicas": self.args.world_size,
            "rank": self.args.process_index,
        }
        if by_user:
            dataset = UnitTaggedDataset(dataset, codes)
            sampler = PoissonUserBatchSampler(
                codes,
                self.dp_plan.sample_rate,
                self.args.gradient_accumulation_steps,
                max_examples_per_user=self.dp_plan.max_examples_per_user,
                **common,
            )
        else:
            sampler = PoissonBatchSampler(
                len(dataset), self.dp_plan.sample_rate, self.args.gradient_accumulation_steps, lengths=lengths, **common
            )
        params: dict[str, Any] = {
            "batch_sampler": sampler,
            # FSDP2: every rank runs every micro-batch (their collectives are shared), so an empty one runs the first
            # example with loss weight 0 (it adds exactly nothing).
            "collate_fn": EmptyBatchSafeCollator(
                collator,
                placeholder=partial(_first_example, dataset) if self.is_fsdp_enabled else None,
                count_key=NUM_EXAMPLES_KEY,  # checked against the per-example losses (hf_dp.sampling.batch_checks)
                unit_key=UNIT_KEY if by_user else None,  # the user of each row, for clipping per user
            ),
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

    def get_batch_samples(self, epoch_iterator, num_batches: int, device) -> tuple[list, None]:
        """The micro-batches of one logical step. ``num_items_in_batch`` (a token count over the whole logical batch,
        which couples examples) is never computed for training; evaluation keeps the Trainer's own loss."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        return batch_samples, None

    def set_initial_training_values(self, args, dataloader, *rest):
        """The Trainer's schedule, with the step count of the privacy plan when ``max_steps`` is not set (the user's
        arguments are never modified)."""
        values = list(super().set_initial_training_values(args, dataloader, *rest))
        num_train_epochs, steps_per_epoch, *_, max_steps = values
        if not (args.max_steps and args.max_steps > 0):
            max_steps = self.dp_plan.num_steps
            values[0] = math.ceil(max_steps / steps_per_epoch)
            values[3] = max_steps * values[4]  # num_train_samples = steps x total batch
            values[-1] = max_steps
        return tuple(values)

    # ------------------------------------------------------------------ loss
    def _label_keys(self) -> set[str]:
        keys = set(self.label_names or []) | {"labels", "shift_labels"}
        if self.loss_type in LABEL_NAMES:
            keys |= set(LABEL_NAMES[self.loss_type])
        return keys

    def _model_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """The batch without label tensors (the model must not compute its own batch-mean loss)."""
        keys = self._label_keys()
        model_inputs = {k: v for k, v in inputs.items() if k not in keys}
        if self.loss_type == "seq2seq_lm" and "decoder_input_ids" not in model_inputs and "labels" in inputs:
            unwrapped = self.accelerator.unwrap_model(model)
            if hasattr(unwrapped, "get_base_model"):
                unwrapped = unwrapped.get_base_model()
            model_inputs["decoder_input_ids"] = unwrapped.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
        return model_inputs

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]`` losses, entry ``i`` depending on example ``i`` alone: ``compute_loss_func(outputs, labels)`` if
        given (``labels``: the batch's label tensor, or a dict of them when it carries several), else the loss of
        ``loss_type`` (with ``label_smoothing_factor`` applied per example). Override to change the loss."""
        present = {k: inputs[k] for k in self._label_keys() if k in inputs}
        if self.compute_loss_func is not None:
            names = [k for k in (self.label_names or ["labels"]) if k in inputs] or sorted(present)
            labels = inputs[names[0]] if len(names) == 1 else {k: inputs[k] for k in names}
            loss = self.compute_loss_func(outputs, labels)
        else:
            loss = per_example_loss(
                self.loss_type,
                outputs,
                present,
                reduction=self.args.per_example_loss_reduction,
                label_smoothing=self.args.label_smoothing_factor,
                model=self.model,
                inputs=inputs,
            )
        batch_size = _batch_size(inputs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 1 or loss.shape[0] != batch_size:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"The per-example loss must have shape [{batch_size}], got {shape}; `compute_loss_func` must return "
                "one loss per example, not a batch mean."
            )
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """During a DP step: ``sum_i loss_i / L`` from per-example losses (the clipper book-keeps its backward).
        Otherwise (evaluation): the Trainer's own loss, so that ``eval_loss`` is what ``Trainer`` reports."""
        if not self._dp_step_active:
            if self.compute_loss_func is None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            outputs = model(**self._model_inputs(model, inputs))
            loss = self.compute_per_example_loss(outputs, inputs).mean()
            return (loss, outputs) if return_outputs else loss
        with self._failing_together():
            outputs = model(**self._model_inputs(model, inputs))
            per_example = self.compute_per_example_loss(outputs, inputs)
            if self._batch_checks is not None:  # one loss per sampled example (shape[0] is on the host: no sync)
                self._batch_checks.after_loss(per_example, self._sampled_examples)
            if self._loss_weight != 1.0:
                per_example = per_example * self._loss_weight
            self.clipper.prepare(per_example, loss_scale=self._loss_scale(), units=self._units)
        self._per_example_loss_seen = True
        if self._loss_weight != 0.0:
            detached = per_example.detach().float()
            self._loss_window[0] += detached.sum().to(self._loss_window.device)
            self._loss_window[1] += detached.numel()
        loss = per_example.sum() / self.dp_plan.expected_batch_size
        return (loss, outputs) if return_outputs else loss

    @contextlib.contextmanager
    def _failing_together(self):
        """FSDP2: an error of this process's forward pass, loss, ``prepare()`` (e.g. a layout it cannot prove) or
        self-check is raised on every process, before the backward pass, instead of leaving the others waiting in
        their next collective (one all-reduced flag per micro-batch)."""
        if self._sharded is None:
            yield
            return
        error, self._deferred_error = self._deferred_error, None
        if error is None:
            try:
                yield
            except Exception as raised:
                error = raised
        if any_process(error is not None, device=self.args.device):
            if error is not None:
                raise error
            raise RuntimeError(
                "hf_dp: another process failed in the forward pass of this micro-batch (see its error); stopping so "
                "that no process waits for it."
            )

    # ------------------------------------------------------------------ step
    def _loss_scale(self) -> float:
        """``w``: the factor between the true per-example gradients and those the backward produced (K / L). With
        fp16, K is the scale policy's (a host float the scaler is set to in ``_dp_step``: no read of the device)."""
        scaler = getattr(self.accelerator, "scaler", None)
        k = 1.0
        if scaler is not None and scaler.is_enabled():
            policy = getattr(self, "_scale_policy", None)
            k = policy.scale if policy is not None else float(scaler.get_scale())
        accumulation = getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1
        return k / (self.dp_plan.expected_batch_size * accumulation)

    def _self_check(self, inputs: dict[str, Any]) -> None:
        """Compare the engine's per-example norms with plain autograd on a few examples, once (DESIGN §4 rule 17)."""
        prepared = self._prepare_inputs(inputs)

        def loss_fn(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
            return self.compute_per_example_loss(model(**self._model_inputs(model, batch)), batch)

        with self.compute_loss_context_manager():
            error = self.clipper.self_check(prepared, loss_fn)
        logger.info("hf_dp self-check passed: per-example norms agree with autograd (max relative error %.2e).", error)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Clipped per-example gradients into ``p.grad``; at the last micro-batch, the noise and the accountant."""
        if not self._in_train:
            raise RuntimeError("DPTrainer.training_step runs inside `train()` only (the clipper is installed there).")
        if not self.is_fsdp_enabled:
            return self._dp_step(model, inputs, num_items_in_batch)
        # FSDP2 (hf_dp.step.fsdp): the clipper is built on the sharded model; a micro-batch in which any process may run
        # passes of the engine's own runs with the whole model on every process, so that they start no collective.
        if self._sharded is None:
            self._sharded = FSDP2Clipping(model, clipped_in_backward=self.dp_plan.clipping_style != "all-layer")
        self._sharded.start()
        size = 1 if PLACEHOLDER_KEY in inputs else (0 if is_empty_batch(inputs) else _batch_size(inputs))
        planning = self.clipper is None or self.clipper.needs_own_passes(size) or self._needs_self_check
        if not any_process(planning, device=self.args.device):
            return self._dp_step(model, inputs, num_items_in_batch)
        with self._sharded.collective_free():
            if self.clipper is None:
                self.clipper = self._build_clipper(
                    model, grad_sink=self._sharded.sink, registered_parameters=self._sharded.registered_parameters()
                )
            self.clipper.allow_own_passes = True
            try:
                return self._dp_step(model, inputs, num_items_in_batch)
            finally:
                self.clipper.allow_own_passes = False

    def _dp_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        scaler = self._enabled_scaler()
        if scaler is not None:
            if self._scale_policy is None:
                threshold = NoisedOverflowScalePolicy.threshold_for(
                    self.dp_plan.noise_multiplier, self.dp_plan.expected_batch_size
                )
                self._scale_policy = NoisedOverflowScalePolicy(scale=float(scaler.get_scale()), threshold=threshold)
            # The scale of this step is the policy's, never GradScaler's own (which would only ever grow: see
            # hf_dp.step.loss_scale); the previous optimizer step has run, so changing it now is safe. Set on the device
            # every micro-batch (a fill, no read back: the scaler's own growth may have changed it).
            if scaler._get_scale_async() is not None:
                scaler.update(new_scale=self._scale_policy.scale)
        scale = self._loss_scale()
        placeholder = inputs.get(PLACEHOLDER_KEY) if is_empty_batch(inputs) else None
        if placeholder is not None:  # FSDP2: run the placeholder example with loss weight 0 (it adds nothing)
            inputs, self._loss_weight = placeholder, 0.0
        self._units = None
        if self.dp_plan.privacy_unit == "user" and not is_empty_batch(inputs):
            inputs = dict(inputs)
            self._units = inputs.pop(UNIT_KEY, None)
            if self._units is None and placeholder is None:
                raise ValueError(
                    "privacy_unit='user': this micro-batch carries no user codes, so its rows cannot be clipped per "
                    "user. Train through DPTrainer's own dataloader (do not override `get_train_dataloader`)."
                )
        if is_empty_batch(inputs):  # a Poisson batch can be empty: no gradient, but the step still counts
            loss = torch.zeros((), device=self.args.device)
        else:
            # What reaches the model is what was sampled (hf_dp.sampling.batch_checks): take the sampled count out of
            # the batch and refuse a packed micro-batch, before the self-check and the backward.
            checks = self._batch_checks or MicroBatchChecks(self.data_collator)
            try:
                self._sampled_examples = checks.before_forward(inputs) if placeholder is None else None
            except ValueError as error:
                if self._sharded is None:
                    raise
                self._deferred_error = error  # FSDP2: raised with the other processes, in compute_loss
            if self._needs_self_check and placeholder is None:
                try:
                    self._self_check(inputs)
                except Exception as error:
                    if self._sharded is None:
                        raise
                    self._deferred_error = error  # FSDP2: raised with the other processes, in compute_loss
                self._needs_self_check = False
            self._dp_step_active, self._per_example_loss_seen = True, False
            # DDP must not reduce: BK puts the clipped sums in p.grad outside autograd, and they are all-reduced
            # once per logical step below (ranks with an empty micro-batch skip the backward without deadlock).
            no_sync = model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()
            try:
                with no_sync:
                    loss = super().training_step(model, inputs, num_items_in_batch)
            except BaseException:
                if self.clipper is not None:  # a refusal raised in the backward: nothing of this pass stays
                    self.clipper.abandon()
                raise
            finally:
                self._dp_step_active, self._loss_weight, self._sampled_examples = False, 1.0, None
            if not self._per_example_loss_seen:
                raise ValueError(
                    f"{type(self).__name__}.compute_loss was overridden and returned a loss that did not go through "
                    "`compute_per_example_loss`: the per-example gradients cannot be clipped, and training would run "
                    "on noise alone. Override `compute_per_example_loss(outputs, inputs)` (one loss per example) or "
                    "pass `compute_loss_func` instead."
                )
            # The backward ran on w * sum_i loss_i: clip at w*C in its units (Li et al. 2022, App. T: K*C in fp16).
            self.clipper.finish(loss_scale=scale)
            if self._adaptive is not None and placeholder is None:  # on the device: read once per optimizer step
                self._adaptive.count(self.clipper.per_example_norms)
            if self._sharded is not None:  # reduce-scatter the clipped sums into the sharded gradients
                self._sharded.flush()
            if scaler is not None:
                # Each example counts the share of its clipping groups whose scaled gradient overflowed (weight 0):
                # with k of G groups kept, its contribution (k groups at C / sqrt(G), count (G - k) / G) has norm at
                # most C, so the noised count stays one Gaussian mechanism with the gradient (hf_dp.step.loss_scale).
                dropped = (~torch.isfinite(self.clipper.per_group_norms)).float().mean(0)
                # summed on the device (float64, as the host sum was): read once per step, by the scale policy
                self._dropped_examples = self._dropped_examples + dropped.sum().to(_count_dtype(dropped.device))
        if self.accelerator.sync_gradients:
            self._ensure_grads()
            dropped = None
            if scaler is not None:
                count = self._dropped_examples
                if isinstance(count, torch.Tensor):
                    dropped = count.to(device=self.args.device, dtype=torch.float32).reshape(1)
                else:
                    dropped = torch.tensor([count], dtype=torch.float32, device=self.args.device)
                self._dropped_examples = 0.0
            # adaptive clipping: the centred count of unclipped units, noised with the gradient (one mechanism)
            count = self._adaptive.take_count() if self._adaptive is not None else None
            if self._sharded is not None:
                # FSDP2: each process holds its shard of the global sum; it adds N(0, sigma^2 C^2) to it from its own
                # stream, so that every coordinate is noised exactly once.
                self._add_noise(scale, None, count if self.accelerator.is_main_process else None)
            elif self.accelerator.is_main_process:
                # Noise once per logical step: the main process adds N(0, sigma^2 C^2) to its share of the sum (and
                # N(0, sigma^2) to the count of dropped examples) before the all-reduce, so the global sums carry it
                # exactly once.
                self._add_noise(scale, dropped, count)
            if self.accelerator.num_processes > 1 and self._sharded is None:
                all_reduce_sum_(
                    [p.grad for p in self._trainable_parameters()]
                    + ([dropped] if dropped is not None else [])
                    + ([count] if count is not None else [])
                )
            if dropped is not None:
                self._scale_policy.update(float(dropped))
            self.dp_callback.record_step(
                noise_multiplier=self.dp_plan.noise_multiplier, sample_rate=self.dp_plan.sample_rate
            )
            if count is not None:  # C of the next step, from this step's noisy count (post-processing)
                if self.accelerator.num_processes > 1 and self._sharded is not None:
                    all_reduce_sum_([count])
                self.dp_callback.clip_norms.append(self._adaptive.clip_norm)
                self.dp_callback.next_clip_norm = self._adaptive.update(count)
                self.clipper.max_grad_norm = self._adaptive.clip_norm
        return loss

    def _trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps on (FSDP2: the sharded ones, also while the model holds the unsharded
        ones inside a collective-free micro-batch)."""
        if self._sharded is not None:
            return self._sharded.trainable_sharded_parameters()
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def _ensure_grads(self) -> None:
        for p in self._trainable_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _enabled_scaler(self):
        scaler = getattr(self.accelerator, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    @torch.no_grad()
    def _add_noise(self, scale: float, dropped: torch.Tensor | None = None, count: torch.Tensor | None = None) -> None:
        """p.grad += w * N(0, sigma^2 C^2), so that after unscaling by K the update is the DP-SGD one,
        (sum + noise) / L; with fp16, ``dropped`` (the count of overflowed examples) += N(0, sigma^2), drawn from
        the same step's stream (one Gaussian mechanism: see hf_dp.step.loss_scale); with adaptive clipping, ``count``
        (the centred count of unclipped units) += N(0, sigma_count^2) and sigma is the gradient's share
        (hf_dp.step.adaptive_clipping). The noise of step ``s`` comes from the run's secret source (never written to
        disk). sigma and C are the frozen plan's (C: the adaptive state's), never the arguments' (a change to the
        arguments during the run raises here, before any noise of the step)."""
        plan = self.dp_plan
        self.dp_callback.check_settings(self.args, self.state.global_step + 1)
        # the gradient's share of the mechanism (larger than sigma with adaptive clipping), at this step's C
        sigma = plan.gradient_noise_multiplier
        clip_norm = self._adaptive.clip_norm if self._adaptive is not None else plan.max_grad_norm
        std = scale * sigma * clip_norm
        if std == 0:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in self._trainable_parameters():
            if self._sharded is not None and not hasattr(p.grad, "to_local"):
                raise RuntimeError("hf_dp: FSDP2 noise must go to the sharded gradients (DTensors).")
            grad = local_tensor(p.grad)  # FSDP2: this process's shard
            by_device.setdefault(grad.device, []).append(grad)
        if dropped is not None:
            by_device.setdefault(dropped.device, []).append(dropped)
        if count is not None:
            by_device.setdefault(count.device, []).append(count)
        for device, targets in by_device.items():
            stds = [sigma if t is dropped else plan.count_noise_multiplier if t is count else std for t in targets]
            noise = self._noise_source.normal(
                step=self.dp_callback.steps,
                shapes=[t.shape for t in targets],
                std=stds,
                device=device,
                dtype=torch.float32,
            )
            # one fused add for every tensor of the device (the same element-wise sums as one add_ per tensor)
            torch._foreach_add_(targets, [n.to(t.dtype) for t, n in zip(targets, noise, strict=True)])

    # ------------------------------------------------------------------ privacy state, logs, train
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
                ledger = PrivacyLedger(self.args.output_dir, callback.run_id, fingerprint)
        callback.configure(
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
            delta=plan.delta,
            accountant=plan.accountant,
            epsilon_budget=plan.target_epsilon,
            num_examples=plan.num_examples,
            frozen_plan=plan,
            ledger=ledger,
        )
        callback.plan = plan.saved()

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
            callback = self.dp_callback
            plan = self.dp_plan
            logs["epsilon"] = callback.epsilon(plan.accountant)
            for name in plan.epsilon_accountants:
                logs[f"epsilon_{name}"] = logs["epsilon"] if name == plan.accountant else callback.epsilon(name)
            if self._adaptive is not None:  # the C of the next step (set from noised counts only)
                logs["clip_norm"] = self._adaptive.clip_norm
        super().log(logs, start_time)

    def _reduce_loss(self, window: torch.Tensor) -> torch.Tensor:
        reduced = window.clone()
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(reduced)
        return reduced.cpu()

    def _restore_dp_state(self, checkpoint: str) -> int:
        """Load the privacy spent from ``checkpoint``; returns its global step.

        The checkpoint's DP state is checked first (:func:`hf_dp.ledger.ledger.check_checkpoint_dp_state`: a missing or
        invalid ``trainer_state.json``, a missing, edited or truncated DP state, or another training set are refused,
        naming the checkpoint to resume from instead). The history is then the larger of the checkpoint's and the
        privacy ledger's for the checkpoint's run: steps taken after the checkpoint (whose checkpoints were deleted by
        ``save_total_limit``, or never written) were still taken on this data, and their models were logged or
        evaluated, so epsilon never goes down across a resume."""
        fingerprint = self._data_fingerprint
        if self._fingerprint_key_new:  # the checkpoint's fingerprint has another folder's key: N is all we can compare
            logger.warning(
                "hf_dp: %s has no fingerprint key (%s) from the run that wrote %s: only the number of training "
                "examples is checked against the checkpoint, not their content.",
                self.args.output_dir,
                KEY_NAME,
                checkpoint,
            )
            fingerprint = {**fingerprint, "rows": None, "datasets": None}
        trainer_state, attributes = check_checkpoint_dp_state(checkpoint, fingerprint)
        spent_unit = (attributes.get("plan") or {}).get("privacy_unit", "example")
        if attributes.get("history") and spent_unit != self.args.privacy_unit:
            raise ValueError(
                f"hf_dp: cannot resume {checkpoint} with `privacy_unit={self.args.privacy_unit!r}`: its privacy was "
                f"spent with `privacy_unit={spent_unit!r}`, and guarantees for different units of privacy do not "
                "compose into one. Resume with the same unit, or start a new run in a new `output_dir`."
            )
        callback = self.dp_callback
        callback.load_state({"attributes": attributes})
        saved = callback.steps
        ledgers = [
            os.path.join(self.args.output_dir, LEDGER_NAME),
            os.path.join(os.path.dirname(os.path.normpath(checkpoint)), LEDGER_NAME),
        ]
        # Every process must resume with the same history (the main one's files; others may not see them).
        recorded = broadcast_from_main([ledger_history(ledgers, callback.run_id)])[0]
        extra = history_steps(recorded) - saved
        if extra > 0:
            logger.warning(
                "hf_dp: the privacy ledger of this run (%s) records %d noisy steps, checkpoint %s only %d: %d steps "
                "were taken after it (their checkpoints deleted, e.g. by `save_total_limit`, or never written). "
                "Resuming with the ledger's %d steps, the larger of the two, so that epsilon accounts every step that "
                "ran.",
                ledgers[0],
                saved + extra,
                checkpoint,
                saved,
                extra,
                saved + extra,
            )
            callback.history = recorded
            callback.plan = {}  # sigma is recalibrated (target_epsilon) for the larger past, never reused
            # With a known sampling seed (tests), the steps after the checkpoint draw fresh batches, never those of
            # the steps already taken after it (a replayed draw is not a fresh one: DESIGN §4 rule 15).
            callback.draw_offset += extra
        elif extra < 0 and self.is_world_process_zero():
            # A ledger that lost lines (or a checkpoint copied from elsewhere): it gets the checkpoint's steps back.
            backfill = PrivacyLedger(self.args.output_dir, callback.run_id, fingerprint)
            index = 0
            for sigma, q, steps in callback.history:
                for _ in range(int(steps)):
                    if index >= saved + extra:
                        backfill.record(index, sigma, q)
                    index += 1
            backfill.flush(sync=True)
        return int(trainer_state.get("global_step", 0))

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train`` with the privacy settings resolved first (restoring the privacy spent when resuming),
        the book-keeping hooks installed for its duration, and fresh secret seeds for the noise and the sampling."""
        check_train_dataset(self.train_dataset)
        check_train_start(self)  # optimizers stepping inside the backward, grad hooks, dispatcher, packing collator
        self._batch_checks = MicroBatchChecks(self.data_collator)
        check_eval_selection(self)  # no checkpoint selection, early stopping or plateau schedule on the training data
        callback = self.dp_callback
        steps_done = 0
        key, self._fingerprint_key_new = broadcast_from_main(
            [fingerprint_key(self.args.output_dir) if self.is_world_process_zero() else None]
        )[0]
        self._data_fingerprint = data_fingerprint(self.train_dataset, key)  # checked on resume, written to the ledger
        if resume_from_checkpoint:
            checkpoint = resume_from_checkpoint
            if checkpoint is True:
                checkpoint = get_last_checkpoint(self.args.output_dir)
                if checkpoint is None:
                    raise ValueError(f"No checkpoint found in output_dir ({self.args.output_dir}) to resume from.")
            steps_done = self._restore_dp_state(checkpoint)
            if self.args.ignore_data_skip:  # the epoch restarts from its first batch: continue with fresh draws
                callback.draw_offset = callback.steps
        else:
            callback.draw_offset = callback.steps  # an earlier train() call used draws [0, steps): continue after it
        self._dp_plan = self._resolve_plan(past=callback.history, saved=callback.plan, steps_done=steps_done)
        self._configure_dp_callback()
        self._start_secret_streams()
        self._adaptive = AdaptiveClippingState.start(self.dp_plan, callback.next_clip_norm, self.args.device)
        self._log_plan()
        # FSDP2 shards the model inside Trainer.train: its clipper is built at the first step (training_step)
        self.clipper = None if self.is_fsdp_enabled else self._build_clipper(self.model)
        self._sharded = None
        self._in_train = True
        self._needs_self_check = self.args.dp_self_check
        self._scale_policy: NoisedOverflowScalePolicy | None = None
        self._dropped_examples = 0.0

        self._loss_window.zero_()
        self._loss_total.zero_()
        try:
            output = super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:
            if self.clipper is not None:
                self.clipper.remove()
            self.clipper, self._sharded, self._in_train = None, None, False
            self._noise_source = self._sampling_seed = None
        return TrainOutput(output.global_step, output.metrics.get("train_loss", output.training_loss), output.metrics)

    def _build_clipper(self, model: nn.Module, **kwargs) -> BookKeepingClipper:
        """The clipper of the frozen plan (C, mode, style, function), never of the arguments."""
        plan = self.dp_plan
        adaptive = getattr(self, "_adaptive", None)
        return BookKeepingClipper(
            model,
            max_grad_norm=adaptive.clip_norm if adaptive is not None else plan.max_grad_norm,
            mode=plan.clipping_mode,
            **self._clipping_policy_kwargs(),
            **kwargs,
        )

    def _clipping_policy_kwargs(self) -> dict[str, Any]:
        return self.dp_plan.clipping_kwargs()

    def _clipping_details(self) -> str | None:
        plan = self.dp_plan
        if plan.clipping_style == "all-layer" and plan.clipping_fn == "abadi":
            return None
        style = plan.clipping_style if isinstance(plan.clipping_style, str) else f"{len(plan.clipping_style)} groups"
        fn = (
            "Abadi (min(1, C_g / norm))"
            if plan.clipping_fn == "abadi"
            else (f"automatic (C_g / (norm + {plan.automatic_clipping_gamma:g}))")
        )
        return f"{style}, each of the G groups clipped at C_g = C / sqrt(G); {fn}"

    def _start_secret_streams(self) -> None:
        """Noise and sampling seeds for this start: from the OS (shared by all processes, never written), or from
        ``noise_seed`` and ``data_seed``/``seed`` in a test run."""
        args = self.args
        stream = args.process_index if self.is_fsdp_enabled else 0  # FSDP2: each process noises its own shards
        if args.noise_seed is not None:
            sampling_seed = args.data_seed if args.data_seed is not None else args.seed
            self._noise_source = NoiseSource(args.noise_seed, secure=args.secure_mode, stream=stream)
        else:
            noise_seed, sampling_seed = broadcast_from_main([secrets.randbits(128), secrets.randbits(128)])
            self._noise_source = NoiseSource(noise_seed, secure=args.secure_mode, stream=stream)
            self._noise_source.deterministic = False
        self._sampling_seed = sampling_seed

    def _log_plan(self) -> None:
        plan = self.dp_plan
        target = "none (fixed sigma)" if plan.target_epsilon is None else f"{plan.target_epsilon:g}"
        logger.warning(
            "hf_dp: DP training with sigma=%.4g, q=%.4g (L=%d of N=%d %ss), %d steps, delta=%.3g, target epsilon=%s "
            "(%s accountant), C=%g%s, clipping=%s%s. Spent so far: %d steps.",
            plan.noise_multiplier,
            plan.sample_rate,
            plan.expected_batch_size,
            plan.num_examples,
            plan.unit_name,
            plan.num_steps,
            plan.delta,
            target,
            plan.accountant.upper(),
            plan.max_grad_norm,
            (
                f" (adaptive: quantile {plan.target_unclipped_quantile:g}; gradient sigma "
                f"{plan.gradient_noise_multiplier:.4g}, count sigma {plan.count_noise_multiplier:.4g})"
                if plan.adaptive_clipping
                else ""
            ),
            plan.clipping_mode,
            ", secure_mode" if plan.secure_mode else "",
            self.dp_callback.steps,
        )
        if self.args.noise_seed is not None:
            logger.warning("hf_dp: `noise_seed` is set: the noise is reproducible by anyone who knows it (tests only).")

    # ------------------------------------------------------------------ release
    def save_metrics(self, split, metrics, combined=True):
        """``Trainer.save_metrics`` without un-noised training statistics (see :mod:`hf_dp.release.filter`)."""
        return super().save_metrics(split, released_metrics(metrics, self.args.publish_training_metrics), combined)

    def save_state(self):
        """``Trainer.save_state``; the written ``trainer_state.json`` holds only released statistics."""
        release_state(self.state, self.args.publish_training_metrics)
        return super().save_state()

    def create_model_card(self, *args, **kwargs) -> None:
        """``Trainer.create_model_card`` from the released log history only, plus the DP section and its tags (set
        by ``_write_dp_section``, the one place that adds the `differential-privacy` tag)."""
        tags = kwargs.pop("tags", None)
        kwargs["tags"] = [tags] if isinstance(tags, str) else list(tags or [])
        history = self.state.log_history
        self.state.log_history = released_log_history(history, self.args.publish_training_metrics)
        try:
            super().create_model_card(*args, **kwargs)
        finally:
            self.state.log_history = history
        if self.is_world_process_zero():
            self._write_dp_section(self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (the plain model or PEFT adapter, never a wrapper) plus the DP model card of this
        moment, in every folder that receives weights (checkpoints too: they are uploaded under ``hub_strategy``)."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.is_world_process_zero():
            self._write_dp_section(output_dir or self.args.output_dir)

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
            self._write_dp_section(self.args.output_dir)
        super()._push_from_checkpoint(checkpoint_folder)

    def _write_dp_section(self, output_dir: str) -> None:
        """The DP section of ``output_dir/README.md`` and hf_dp's tags: `differential-privacy` only with a finite
        epsilon; without one (noise multiplier 0) the card says there is no guarantee, and there is no plot."""
        points = [(h["step"], h["epsilon"]) for h in self.state.log_history if "epsilon" in h and "step" in h]
        plot = None
        if (
            points
            and all(math.isfinite(eps) for _, eps in points)
            and plot_epsilon_curve(points, os.path.join(output_dir, EPSILON_PLOT), accountant=self.dp_plan.accountant)
        ):
            plot = EPSILON_PLOT
        section = self.dp_model_card_section(epsilon_plot=plot)
        write_dp_model_card(output_dir, section, tags=card_tags(self.epsilon()))

    def dp_model_card_section(self, epsilon_plot: str | None = None) -> str:
        """The "Differential privacy" section of the model card, for the privacy spent so far."""
        plan = self.dp_plan
        if self.dp_callback.delta is None:  # no train() yet: the card states the plan and zero steps
            self._configure_dp_callback()
        callback = self.dp_callback
        names = sorted({plan.accountant, *plan.epsilon_accountants})
        optimizer = self.optimizer
        while optimizer is not None and hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer wrapper
            optimizer = optimizer.optimizer
        published = unreleased_log_keys(self.state.log_history) if self.args.publish_training_metrics else []
        return render_dp_section(
            DPModelCardData(
                epsilons={name: callback.epsilon(name) for name in names},
                accountant=plan.accountant,
                delta=plan.delta,
                segments=[tuple(s) for s in callback.history] or [(plan.noise_multiplier, plan.sample_rate, 0)],
                expected_batch_size=plan.expected_batch_size,
                num_examples=plan.num_examples,
                max_grad_norm=plan.max_grad_norm,
                clipping_mode=plan.clipping_mode,
                clipping_details=self._clipping_details(),
                poisson_sampling=plan.poisson_sampling,
                optimizer=type(optimizer).__name__ if optimizer is not None else str(self.args.optim),
                secure_mode=plan.secure_mode,
                fixed_noise_seed=self.args.noise_seed is not None,
                published_training_metrics=published,
                audit=self.dp_audit_result,
                epsilon_plot=epsilon_plot,
                user_column=plan.user_column,
                max_examples_per_user=plan.max_examples_per_user,
                num_rows=plan.num_rows,
                adaptive_clipping=self._adaptive_card_fields(),
                **eval_card_fields(self),
            )
        )

    def _adaptive_card_fields(self) -> dict[str, Any] | None:
        plan = self.dp_plan
        if not plan.adaptive_clipping:
            return None
        return {
            "target_quantile": plan.target_unclipped_quantile,
            "learning_rate": plan.clipping_norm_lr,
            "count_noise_multiplier": plan.count_noise_multiplier,
            "gradient_noise_multiplier": plan.gradient_noise_multiplier,
            "clip_norms": list(self.dp_callback.clip_norms),
        }

    def record_audit(self, result) -> None:
        """Carry a privacy audit's result (``hf_dp.audit``; an object with ``card_fields()`` or a dict) on the card."""
        self.dp_audit_result = dict(result.card_fields() if hasattr(result, "card_fields") else result)


def _batch_size(inputs: dict[str, Any]) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("The batch has no tensor with a batch dimension.")


def _first_example(dataset) -> list:
    return [dataset[0]]


def _count_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (the dropped-example count is summed as the host's Python floats were)."""
    return torch.float32 if device.type == "mps" else torch.float64
