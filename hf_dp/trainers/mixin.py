"""``DPTrainerMixin``: what makes a transformers ``Trainer`` class train with differential privacy.

Each override is a short delegation along the data path (``docs/architecture.md``):

* ``get_train_dataloader``: Poisson logical batches of examples or users, from a secret seed (:mod:`hf_dp.sampling`);
* ``compute_loss``: one loss per example (:mod:`hf_dp.losses`), handed to the DP step (the clipper book-keeps it);
* ``training_step``: the micro-batch's backward, clipped into ``p.grad``; at the last micro-batch of a logical batch,
  the noise, the all-reduce and the privacy record (:class:`~hf_dp.step.dp_step.DPStep`), before the Trainer reads
  ``grad_norm``;
* ``train``: the frozen plan of the run (:mod:`hf_dp.plan`), resolved from the arguments, the data and the privacy
  already spent (:mod:`hf_dp.ledger`: resume), the DP step built for its duration (the book-keeping hooks live only
  while ``train()`` runs; afterwards the model is a plain model again);
* ``log``: epsilon at every logging step; ``save_*``, ``create_model_card``, uploads: through :mod:`hf_dp.release`.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.trainer_utils import TrainOutput

from ..arguments import DPTrainingArguments
from ..engine import BookKeepingClipper
from ..ledger.callback import DPCallback
from ..losses import LABEL_NAMES, call_loss_function, infer_loss_type, per_example_loss
from ..plan.checks import check_before_init, check_train_dataset, check_train_start, dp_arguments
from ..plan.privacy_plan import DPPlan, resolve_plan
from ..plan.report import log_plan, plan_summary
from ..release.eval_overlap import check_eval_selection, withheld_metric_prefixes
from ..release.filter import release_state
from ..sampling.batch_checks import MicroBatchChecks
from ..sampling.collators import MicroBatch, batch_size, unpack_micro_batch
from ..sampling.privacy_unit import UNIT_KEY, user_codes
from ..step.adaptive_state import AdaptiveClippingState
from ..step.backends import DataParallel, FullySharded
from ..step.distributed import broadcast_from_main
from ..step.dp_step import DPStep, DPStepSettings
from ..step.loss_scale import NoisedLossScaling
from ..step.noise import NoiseSource
from .banded import check_banded_continuation, check_banded_plan, noise_streams
from .composition import InitArguments, next_init
from .coupled import check_trainer_class
from .record_hooks import PrivacyRecordHooks
from .release_hooks import ReleaseHooks
from .sampling_hooks import SamplingHooks

logger = logging.getLogger("hf_dp")

__all__ = ["DPTrainerMixin"]


class DPTrainerMixin(SamplingHooks, PrivacyRecordHooks, ReleaseHooks):
    """The DP core of :class:`~hf_dp.DPTrainer`, :class:`~hf_dp.DPSeq2SeqTrainer` and the TRL trainers (use those):
    the per-example loss and the DP step here, the sampling, privacy-record and release hooks in their own modules."""

    # No `_tag_names`: TRL's trainers tag the model with it at init; the DP tags go only where the DP card is written.
    #: The arguments class this trainer takes.
    _dp_arguments_class: type = DPTrainingArguments
    loss_is_scaled_for_ga = True  # compute_loss returns sum_i loss_i / L: nothing to divide by accumulation

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The arguments of the trainer class this mixin sits on, in its order (any ``Trainer`` subclass: unknown
        arguments pass through, :mod:`hf_dp.trainers.composition`); ``args`` must be DP arguments, ``model_init`` is
        refused, a :class:`~hf_dp.DPCallback` is added to ``callbacks``; a TRL trainer whose loss couples examples
        (KTO, GRPO, RLOO) is refused (:mod:`.coupled`)."""
        check_trainer_class(type(self))
        optimizer_cls_and_kwargs = kwargs.pop("optimizer_cls_and_kwargs", None)  # set below: not every trainer takes it
        model_init = kwargs.pop("model_init", None)
        call = InitArguments(next_init(type(self), DPTrainerMixin), args, kwargs)
        model_init = call.pop("model_init", model_init)
        dp_args = dp_arguments(call.get("args"), self._dp_arguments_class)
        call.set("args", dp_args)
        check_before_init(
            call.get("model"),
            dp_args,
            call.get("train_dataset"),
            model_init,
            data_collator=call.get("data_collator"),
            optimizers=call.get("optimizers", (None, None)),
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        call.set("callbacks", [*(call.get("callbacks") or []), DPCallback()])
        call.call(super().__init__)
        if optimizer_cls_and_kwargs is not None:
            if self.optimizer is not None:
                raise RuntimeError(
                    "Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible."
                )
            self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self._init_dp_state()
        if self.train_dataset is not None:  # bad settings fail now, not after the model is loaded on every GPU
            self._dp_plan = self._resolve_plan()

    def _init_dp_state(self) -> None:
        args = self.args
        # a subclass with its own per-example loss (docs/trainer_subclasses.md) needs no loss type of hf_dp's
        own_loss = type(self).compute_per_example_loss is not DPTrainerMixin.compute_per_example_loss
        self.loss_type = (
            args.dp_loss_type
            if args.dp_loss_type != "auto" or self._loss_function is not None or own_loss
            else infer_loss_type(self.model)
        )
        self.dp_step: DPStep | None = None  # built by train() for its duration
        self.dp_audit_result: dict[str, Any] | None = None
        self._dp_plan: DPPlan | None = None
        self._sampling_seed: int | None = None
        self._banded_strategy = None  # the banded noise strategy of the running or last train() (card)
        self._dp_step_active = False
        self._per_example_loss_seen = False
        self._needs_self_check = False
        self._batch_checks: MicroBatchChecks | None = None  # what reaches the model is what was sampled (train())
        self._sampled_examples: int | None = None  # examples the sampler put in the current micro-batch
        self._units = None  # privacy_unit="user": the user of each example of the current micro-batch (CPU codes)
        self._loss_weight = 1.0  # 0 for the placeholder an FSDP2 rank runs for its empty micro-batch
        self._in_train = False
        # [sum of per-example losses, examples] since the last log, and over this train() call; on the device, so that
        # accumulating them never waits for the device (read at logging steps only).
        self._loss_window = torch.zeros(2, device=args.device)
        self._loss_total = torch.zeros(2, device=args.device)
        release_state(self.state, args.publish_training_metrics)

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
        callback = self.dp_callback
        epsilon = callback.epsilon(self.dp_plan.accountant) if callback.delta else 0.0
        return plan_summary(self.dp_plan, steps_taken=callback.steps, epsilon=epsilon)

    # ------------------------------------------------------------------ per-example loss
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

    @property
    def _loss_function(self):
        """The user's ``compute_loss_func`` (`None`: the per-example loss of ``loss_type``)."""
        return getattr(self, "compute_loss_func", None)

    def dp_forward(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        """The model's outputs on a micro-batch, for :meth:`compute_per_example_loss`: ``model(**inputs)`` without the
        label tensors. A trainer whose model is not called that way (several forward passes, inputs per column)
        overrides this and :meth:`compute_per_example_loss` (docs/trainer_subclasses.md)."""
        return model(**self._model_inputs(model, inputs))

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]`` losses, entry ``i`` depending on example ``i`` alone: ``compute_loss_func(outputs, labels)`` if
        given (``labels``: the batch's label tensor, or a dict of them when it carries several; transformers' third
        argument ``num_items_in_batch`` is `None`: a count over the batch would couple the examples), else the loss of
        ``loss_type`` (with ``label_smoothing_factor`` applied per example). Override to change the loss."""
        present = {k: inputs[k] for k in self._label_keys() if k in inputs}
        if self._loss_function is not None:
            names = [k for k in (self.label_names or ["labels"]) if k in inputs] or sorted(present)
            labels = inputs[names[0]] if len(names) == 1 else {k: inputs[k] for k in names}
            loss = call_loss_function(self._loss_function, outputs, labels)
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
        return loss

    def _checked_per_example(self, loss: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """The per-example losses: a ``[B]`` tensor (``B`` the batch's rows, unless the sampler recorded how many
        examples it put in the micro-batch: the batch checks then compare with that count); a batch mean, or a sum
        normalized by a count over the batch, is refused."""
        rows = self._sampled_examples if self._sampled_examples is not None else batch_size(inputs)
        if (
            not isinstance(loss, torch.Tensor)
            or loss.dim() != 1
            or (self._sampled_examples is None and loss.shape[0] != rows)
        ):
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"The per-example loss must have shape [{rows}], got {shape}: `compute_per_example_loss` (or "
                "`compute_loss_func`) must return one loss per example, not a batch mean (nor a sum normalized by "
                "`num_items_in_batch`, a count over the batch: hf_dp passes `num_items_in_batch=None`)."
            )
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """During a DP step: ``sum_i loss_i / L`` from per-example losses (the clipper book-keeps its backward).
        Otherwise (evaluation): the Trainer's own loss, so that ``eval_loss`` is what ``Trainer`` reports."""
        if not self._dp_step_active:
            if self._loss_function is None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            outputs = self.dp_forward(model, inputs)
            loss = self.compute_per_example_loss(outputs, inputs).mean()
            return (loss, outputs) if return_outputs else loss
        with self.dp_step.backend.failing_together():
            outputs = self.dp_forward(model, inputs)
            per_example = self._checked_per_example(self.compute_per_example_loss(outputs, inputs), inputs)
            if self._batch_checks is not None:  # one loss per sampled example (shape[0] is on the host: no sync)
                self._batch_checks.after_loss(per_example, self._sampled_examples)
            if self._loss_weight != 1.0:
                per_example = per_example * self._loss_weight
            loss = self.dp_step.prepare(per_example, units=self._units)
        self._per_example_loss_seen = True
        if self._loss_weight != 0.0:
            detached = per_example.detach().float()
            self._loss_window[0] += detached.sum().to(self._loss_window.device)
            self._loss_window[1] += detached.numel()
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ clip, noise
    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Clipped per-example gradients into ``p.grad``; at the last micro-batch, the noise and the privacy record."""
        if not self._in_train:
            raise RuntimeError("DPTrainer.training_step runs inside `train()` only (the clipper is installed there).")
        step = self.dp_step
        batch = unpack_micro_batch(inputs, unit_key=UNIT_KEY if self.dp_plan.privacy_unit == "user" else None)
        with step.backend.micro_batch(step, model, batch_size=batch.rows, needs_self_check=self._needs_self_check):
            step.begin_micro_batch(loss_division=getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1)
            self._units = batch.units
            if batch.empty:  # a Poisson batch can be empty: no gradient, but the step still counts
                loss = torch.zeros((), device=self.args.device)
            else:
                loss = self._clipped_backward(model, batch, num_items_in_batch)
            if self.accelerator.sync_gradients:
                # sigma and C are the frozen plan's, never the arguments' (a change to them raises here, before noise)
                self.dp_callback.check_settings(self.args, self.state.global_step + 1)
                step.privatize(device=self.args.device)
        return loss

    def _clipped_backward(self, model, batch: MicroBatch, num_items_in_batch) -> torch.Tensor:
        """The micro-batch's forward and one book-kept backward: its clipped sum lands in the gradients. What reaches
        the model is what was sampled (:mod:`hf_dp.sampling.batch_checks`): the sampled count is taken out of the
        batch, and a packed micro-batch refused, before the self-check and the backward."""
        step, inputs = self.dp_step, batch.inputs
        checks = self._batch_checks or MicroBatchChecks(self.data_collator)
        self._loss_weight = 0.0 if batch.placeholder else 1.0  # FSDP2: the placeholder example adds nothing
        try:
            self._sampled_examples = None if batch.placeholder else checks.before_forward(inputs)
        except ValueError as error:
            step.backend.defer(error)  # FSDP2: raised with the other processes, in compute_loss
        if self._needs_self_check and not batch.placeholder:
            try:
                self._self_check(inputs)
            except Exception as error:
                step.backend.defer(error)
            self._needs_self_check = False
        self._dp_step_active, self._per_example_loss_seen = True, False
        try:
            with step.backend.without_gradient_sync(model):
                loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            step.abandon()
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
        step.accumulate(count_units=not batch.placeholder)
        return loss

    def _self_check(self, inputs: dict[str, Any]) -> None:
        """Compare the engine's per-example norms with plain autograd on a few examples, once (DESIGN §4 rule 17)."""
        prepared = self._prepare_inputs(inputs)

        def loss_fn(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
            return self.compute_per_example_loss(self.dp_forward(model, batch), batch)

        with self.compute_loss_context_manager():
            error = self.dp_step.clipper.self_check(prepared, loss_fn)
        logger.info("hf_dp self-check passed: per-example norms agree with autograd (max relative error %.2e).", error)

    @property
    def clipper(self) -> BookKeepingClipper | None:
        """The book-keeping clipper of the running ``train()`` (``None`` outside it)."""
        return self.dp_step.clipper if self.dp_step is not None else None

    def _build_dp_step(self, noise: NoiseSource, count_noise: NoiseSource | None = None) -> DPStep:
        """The DP step of this ``train()`` call, from the frozen plan (never the arguments)."""
        plan, args, callback = self.dp_plan, self.args, self.dp_callback
        adaptive = AdaptiveClippingState.start(
            plan.quantile_clipping,
            max_grad_norm=plan.max_grad_norm,
            expected_batch_size=plan.expected_batch_size,
            resumed_clip_norm=callback.next_clip_norm,
            device=args.device,
        )
        scaler = getattr(self.accelerator, "scaler", None)
        loss_scaling = None
        if scaler is not None and scaler.is_enabled():
            loss_scaling = NoisedLossScaling(
                scaler, noise_multiplier=plan.noise_multiplier, expected_batch_size=plan.expected_batch_size
            )
        settings = DPStepSettings(
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
            expected_batch_size=plan.expected_batch_size,
            max_grad_norm=plan.max_grad_norm,
            gradient_noise_multiplier=plan.gradient_noise_multiplier,
            count_noise_multiplier=plan.count_noise_multiplier,
        )
        step = DPStep(
            settings,
            noise=noise,
            record=self._privacy_record(),
            backend=self._dp_backend(),
            loss_scaling=loss_scaling,
            adaptive=adaptive,
            count_noise=count_noise,
        )
        # FSDP2 shards the model inside Trainer.train: its clipper is built at the first micro-batch (the back end)
        step.clipper = None if self.is_fsdp_enabled else self._build_clipper(self.model, clip_norm=step.clip_norm)
        return step

    def _dp_backend(self) -> DataParallel | FullySharded:
        accelerator = self.accelerator
        if not self.is_fsdp_enabled:
            return DataParallel(
                self.model, is_main_process=accelerator.is_main_process, num_processes=accelerator.num_processes
            )
        return FullySharded(
            clipped_in_backward=self.dp_plan.clipping_style != "all-layer",
            process_index=self.args.process_index,
            is_main_process=accelerator.is_main_process,
            num_processes=accelerator.num_processes,
            build_clipper=lambda model, **kwargs: self._build_clipper(
                model, clip_norm=self.dp_step.clip_norm, **kwargs
            ),
            device=self.args.device,
        )

    def _build_clipper(self, model: nn.Module, *, clip_norm: float, **kwargs) -> BookKeepingClipper:
        """The clipper of the frozen plan (mode, style, function), never of the arguments, clipping at ``clip_norm``."""
        return BookKeepingClipper(
            model, max_grad_norm=clip_norm, mode=self.dp_plan.clipping_mode, **self._clipping_policy_kwargs(), **kwargs
        )

    def _clipping_policy_kwargs(self) -> dict[str, Any]:
        return self.dp_plan.clipping_kwargs()

    def _secret_streams(self) -> tuple[NoiseSource, NoiseSource | None, int]:
        """The gradient noise, the separate count noise (banded noise only) and the sampling seed of this start: from
        the OS (shared by all processes, never written), or from ``noise_seed`` and ``data_seed``/``seed`` in a test
        run. FSDP2: each process noises its own shards. The banded strategy is kept for the card."""
        args = self.args
        stream = args.process_index if self.is_fsdp_enabled else 0
        if args.noise_seed is not None:
            noise_seed = args.noise_seed
            sampling_seed = args.data_seed if args.data_seed is not None else args.seed
        else:
            noise_seed, sampling_seed = broadcast_from_main([secrets.randbits(128), secrets.randbits(128)])

        def source(index: int) -> NoiseSource:
            made = NoiseSource(noise_seed, secure=args.secure_mode, stream=index)
            made.deterministic = args.noise_seed is not None
            return made

        # banded noise: fp16's dropped count from stream -1 - stream of the same secret (never the gradients' normals)
        noise, count_noise, self._banded_strategy = noise_streams(
            self.dp_plan, source(stream), lambda: source(-1 - stream), self
        )
        return noise, count_noise, sampling_seed

    # ------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train`` with the privacy settings resolved first (restoring the privacy spent when resuming),
        the DP step (and its book-keeping hooks) built for its duration, and fresh secret seeds for the noise and the
        sampling."""
        check_train_dataset(self.train_dataset)
        check_train_start(self)  # optimizers stepping inside the backward, grad hooks, dispatcher, packing collator
        self._check_training_data()  # sequences of length 0, no target to learn
        self._batch_checks = MicroBatchChecks(self.data_collator)
        check_eval_selection(self)  # no checkpoint selection, early stopping or plateau schedule on the training data
        self.dp_callback.withheld_metrics = withheld_metric_prefixes(self)  # eval metrics on training data: not written
        steps_done = self._start_privacy_record(resume_from_checkpoint)
        callback = self.dp_callback
        check_banded_continuation(self.args, callback, resuming=bool(resume_from_checkpoint))  # sets callback.bands
        past = callback.accounted_history()
        self._dp_plan = self._resolve_plan(past=past, saved=callback.plan, steps_done=steps_done)
        check_banded_plan(self.dp_plan, callback)
        self._configure_dp_callback()
        noise, count_noise, self._sampling_seed = self._secret_streams()
        log_plan(self.dp_plan, steps_taken=callback.steps, fixed_noise_seed=self.args.noise_seed is not None)
        self.dp_step = self._build_dp_step(noise, count_noise)
        self._in_train = True
        self._needs_self_check = self.args.dp_self_check
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
            if self.dp_step.clipper is not None:
                self.dp_step.clipper.remove()
            self.dp_step.clipper, self.dp_step.noise, self._in_train = None, None, False
            self.dp_step.count_noise = None
            self._sampling_seed = None
            self._release_after_train()
        return TrainOutput(output.global_step, output.metrics.get("train_loss", output.training_loss), output.metrics)
