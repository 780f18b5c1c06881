"""DP preference optimisation for TRL: :class:`DPDPOTrainer` / :class:`DPDPOConfig` (Direct Preference Optimization).

TRL's ``dpo.py`` changes three names: ``DPOConfig`` -> ``DPDPOConfig``, ``DPOTrainer`` -> ``DPDPOTrainer`` and the
import. The dataset formats (standard and conversational ``prompt``/``chosen``/``rejected``, or implicit prompts), the
tokenisation, the collator, ``peft_config``, the reference model (a frozen copy of the initial policy, an explicit
``ref_model``, the PEFT base model with the adapter disabled, or ``precompute_ref_log_probs``) and evaluation are
TRL's.

The unit of privacy is one preference pair ``(prompt, chosen, rejected)``, or with ``privacy_unit="user"`` every pair
of one user (``user_column``; the user's pairs are clipped together). The training step is hf_dp's
(:class:`~hf_dp.trainers.mixin.DPTrainerMixin`), with one loss per pair: TRL concatenates the chosen and rejected
sequences of a micro-batch into one forward pass of ``2B`` rows; a DP step instead arranges the batch as ``B`` pairs
``[B, 2, T]`` and runs the policy twice (the chosen rows, then the rejected rows: ``B`` rows each, both passes book-kept
by the engine),
so that the loss of pair ``i`` depends on pair ``i`` alone:

    loss_i = -log sigmoid(beta * ((log pi(c_i) - log ref(c_i)) - (log pi(r_i) - log ref(r_i))))

(``loss_type="sigmoid"``, TRL's default), with ``log pi(c_i)`` the policy's summed log-probability of pair ``i``'s
chosen completion tokens. The reference log-probabilities are computed under ``torch.no_grad()`` before the policy's
book-kept passes (or read from the dataset with ``precompute_ref_log_probs``): the reference model is never hooked,
never clipped and never noised, and gets no gradient.

This module imports TRL; ``import hf_dp`` does not. Install it with ``pip install 'hf_dp[trl]'``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..losses import IGNORE_INDEX
from ..sampling.collators import is_empty_batch
from ..sampling.privacy_unit import UNIT_KEY
from .dpo_config import DPDPOConfig, check_dpo_fields
from .mixin import DPTrainerMixin
from .trl_common import DPOTrainer, pair_card_section, prepare_trl_init, quiet_model_init_kwargs_warning

logger = logging.getLogger("hf_dp")

__all__ = ["DPDPOTrainer"]

#: The batch keys TRL's preference collator returns with ``2B`` rows (chosen rows first, then rejected rows).
_ROW_KEYS = ("input_ids", "attention_mask", "completion_mask")
_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


class _DPOTrainerInit(DPOTrainer):
    """Takes the Trainer's arguments from :class:`DPTrainerMixin` and adds DPOTrainer's own (``ref_model``,
    ``peft_config``, ``quantization_config``), set by :class:`DPDPOTrainer` before."""

    def __init__(self, *, model_init=None, compute_loss_func=None, preprocess_logits_for_metrics=None, **kwargs):
        # model_init, compute_loss_func, preprocess_logits_for_metrics: always None (DPOTrainer does not take them)
        extra = self.__dict__.pop("_dp_dpo_init_kwargs", {})
        super().__init__(**kwargs, **extra)


class _PairPolicy:
    """What :meth:`DPTrainerMixin.compute_loss` calls as ``model(**inputs)`` in a DP step: the policy run twice
    (chosen rows, then rejected rows), returning the per-token log-probabilities of each pair's completions."""

    def __init__(self, trainer: DPDPOTrainer, model: torch.nn.Module) -> None:
        self.trainer, self.model = trainer, model

    def __call__(self, **inputs) -> dict[str, torch.Tensor]:
        return self.trainer.policy_log_probs(self.model, inputs)


class DPDPOTrainer(DPTrainerMixin, _DPOTrainerInit):
    """Drop-in replacement for TRL's :class:`~trl.DPOTrainer` that trains with (epsilon, delta)-differential privacy,
    the unit of privacy being one preference pair (or every pair of one user, with ``privacy_unit="user"``).

    Takes DPOTrainer's arguments (``model`` as a Hub id, a local path or a model object; ``ref_model``;
    ``peft_config``; ``quantization_config``; ...) with ``args`` a :class:`DPDPOConfig`. Standard and conversational
    preference datasets (``prompt``/``chosen``/``rejected``, or ``chosen``/``rejected`` with an implicit prompt) are
    prepared by TRL.

    In a DP step the policy runs twice per micro-batch, on the ``B`` chosen sequences and on the ``B`` rejected ones
    (both passes book-kept: the per-pair gradient norm includes the cross terms between them), and the loss of pair
    ``i`` is TRL's DPO loss of pair ``i`` alone (``sigmoid``: ``-log sigmoid(beta * (chosen log-ratio - rejected
    log-ratio))``), from the summed log-probabilities of its completion tokens under the policy and the reference;
    never a batch mean. The reference model (``ref_model``; by default a frozen copy of the initial policy; with a
    PEFT policy, the base model with the adapter disabled, as TRL does) runs under ``torch.no_grad()`` outside the
    book-kept passes, or not at all with ``precompute_ref_log_probs=True``: it gets no hooks, no noise and no gradient.

    TRL's training metrics (``rewards/chosen``, ``rewards/margins``, ``rewards/accuracies``, ``logps/*``,
    ``logits/*``, ``entropy``, ``num_tokens``) are un-noised statistics of the training pairs: they are not computed
    in DP steps. Evaluation is TRL's (``eval_loss`` and the ``eval_rewards/*`` metrics).

    Raises:
        ValueError: before training, for any setting that would break the guarantee.

    Example:
        ```python
        from hf_dp import DPDPOConfig, DPDPOTrainer   # was: from trl import DPOConfig, DPOTrainer

        args = DPDPOConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=1.0,
                           per_device_train_batch_size=8, gradient_accumulation_steps=32, learning_rate=1e-4)
        trainer = DPDPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", args=args, train_dataset=pairs,
                               peft_config=LoraConfig(r=16, target_modules="all-linear"))
        trainer.train()
        ```
    """

    _dp_arguments_class = DPDPOConfig

    def __init__(
        self,
        model: Any,
        ref_model: torch.nn.Module | None = None,
        args: DPDPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics: Callable | None = None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        quantization_config=None,
        peft_config=None,
    ):
        from accelerate.utils import is_peft_model

        args, model, processing_class, quantization_config, loaded_from = prepare_trl_init(
            "DPDPOTrainer",
            DPDPOConfig,
            check_dpo_fields,
            args,
            model,
            train_dataset,
            quantization_config,
            processing_class,
        )
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object; omit `ref_model` to use a copy.")
        if ref_model is None and peft_config is None and not is_peft_model(model) and not args.precompute_ref_log_probs:
            # The reference is the initial policy: a frozen copy of it (TRL would load it again from the model's
            # name, which a model built from a config does not have).
            ref_model = _frozen_copy(model)
        self._dp_dpo_init_kwargs = {
            "ref_model": ref_model,
            "quantization_config": quantization_config,
            "peft_config": peft_config,
        }
        from trl.trainer import dpo_trainer

        with quiet_model_init_kwargs_warning(loaded_from is not None, dpo_trainer):
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
            )

    # ------------------------------------------------------------------ batch
    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The micro-batch as ``B`` pairs (``[B, 2, T]``, with the reference log-probabilities of each pair), then
        hf_dp's DP step."""
        if self._in_train and not is_empty_batch(inputs):
            inputs = self._pair_batch(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def _pair_batch(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """TRL's ``[2B, T]`` batch (chosen rows, then rejected rows) as ``[B, 2, T]`` pairs, with ``ref_chosen_logps``
        and ``ref_rejected_logps`` ``[B]`` (computed now under ``no_grad``, outside the engine's passes, unless they
        were precomputed)."""
        if "input_ids" not in inputs or "completion_mask" not in inputs:
            raise ValueError(
                "DPDPOTrainer expects the batches of TRL's preference collator (`input_ids`, `attention_mask`, "
                f"`completion_mask`), got keys {sorted(inputs)}."
            )
        rows = inputs["input_ids"].shape[0]
        if rows % 2:
            raise ValueError(f"A preference batch has chosen and rejected rows (an even number), got {rows}.")
        batch = dict(inputs)
        units = batch.pop(UNIT_KEY, None)  # privacy_unit="user": one user code per pair, kept on the host
        for key, value in list(batch.items()):
            if key in _ROW_KEYS:
                batch[key] = torch.stack(value.chunk(2, dim=0), dim=1)  # [B, 2, T]: pair i's chosen and rejected rows
            elif key not in _REF_KEYS and isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ValueError(
                    f"DPDPOTrainer does not know how to split the batch key {key!r} (shape {tuple(value.shape)}) into "
                    "preference pairs; use TRL's preference collator (`DataCollatorForPreference`)."
                )
        if not all(key in batch for key in _REF_KEYS):
            batch = self._prepare_inputs(batch)
            batch["ref_chosen_logps"], batch["ref_rejected_logps"] = self.reference_log_probs(batch)
        if units is not None:
            batch[UNIT_KEY] = units
        return batch

    @torch.no_grad()
    def reference_log_probs(self, pairs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ref_chosen_logps, ref_rejected_logps)``, each ``[B]``, of a ``[B, 2, T]`` batch of pairs, under
        ``no_grad``: from ``ref_model``, or (PEFT, as TRL) from the policy with its adapter disabled (or TRL's "ref"
        adapter active). Computed exactly as the policy's log-probabilities (same dtype, same reduction), so that the
        log-ratios of the initial policy are exactly zero."""
        from accelerate.utils import is_peft_model
        from trl.models.utils import disable_gradient_checkpointing
        from trl.trainer.utils import use_adapter

        contexts = contextlib.ExitStack()
        if self.ref_model is not None:
            model = self.ref_model
        elif is_peft_model(self.model):
            model = self.model
            unwrapped = self.accelerator.unwrap_model(self.model)
            contexts.enter_context(disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs))
            adapter = "ref" if "ref" in unwrapped.peft_config else None  # TRL's copy of a pretrained adapter
            contexts.enter_context(use_adapter(unwrapped, adapter_name=adapter))
        else:
            raise RuntimeError(
                "DPDPOTrainer has no reference model: pass `ref_model`, use PEFT, or `precompute_ref_log_probs=True`."
            )
        with contexts, self.compute_loss_context_manager():
            logps = self.policy_log_probs(model, pairs)
        mask = pairs["completion_mask"]
        chosen_mask, rejected_mask = mask[:, 0, 1:], mask[:, 1, 1:]
        chosen = self._sequence_log_probs(logps["chosen_per_token_logps"], chosen_mask, rejected_mask)
        rejected = self._sequence_log_probs(logps["rejected_per_token_logps"], rejected_mask, chosen_mask)
        return chosen.detach(), rejected.detach()

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """In a DP step: hf_dp's per-example loss over the pairs (:meth:`compute_per_example_loss`), the policy run
        once on the chosen rows and once on the rejected rows. Otherwise (evaluation): TRL's own DPO loss."""
        if not self._dp_step_active:
            return DPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(_PairPolicy(self, model), inputs, return_outputs, num_items_in_batch)

    def policy_log_probs(self, model, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The policy's per-token log-probabilities of each pair's chosen and rejected completion tokens
        (``[B, T-1]`` each, zero elsewhere) from two forward passes of ``B`` rows (``inputs`` as ``[B, 2, T]``)."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        completion_mask = inputs["completion_mask"]
        seq_len = input_ids.shape[-1]
        logps = []
        for j in (0, 1):  # chosen, rejected
            ids = input_ids[:, j]
            outputs = model(input_ids=ids, attention_mask=attention_mask[:, j], use_cache=False)
            logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
            # Prompt-learning PEFT prepends virtual tokens to the outputs: keep the positions of the real tokens
            logits = logits[:, -seq_len:][:, :-1]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            labels = ids[:, 1:].masked_fill(completion_mask[:, j, 1:] == 0, IGNORE_INDEX)
            nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
            logps.append(-nll)  # zero where the label is ignored
        return {"chosen_per_token_logps": logps[0], "rejected_per_token_logps": logps[1]}

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]``: TRL's DPO loss (``loss_type``, weighted by ``loss_weights``) of each pair alone."""
        chosen_tok, rejected_tok = outputs["chosen_per_token_logps"], outputs["rejected_per_token_logps"]
        completion_mask = inputs["completion_mask"]
        chosen_shift, rejected_shift = completion_mask[:, 0, 1:], completion_mask[:, 1, 1:]
        chosen_logps = self._sequence_log_probs(chosen_tok, chosen_shift, rejected_shift)
        rejected_logps = self._sequence_log_probs(rejected_tok, rejected_shift, chosen_shift)
        ref_chosen = inputs["ref_chosen_logps"].to(chosen_logps)
        ref_rejected = inputs["ref_rejected_logps"].to(rejected_logps)
        chosen_logratios = chosen_logps - ref_chosen
        rejected_logratios = rejected_logps - ref_rejected
        chosen_scores, rejected_scores = self._f_scores(chosen_logratios), self._f_scores(rejected_logratios)
        lengths = (completion_mask[:, 0].sum(1).clamp(min=1.0), completion_mask[:, 1].sum(1).clamp(min=1.0))
        chosen_nll = (-chosen_tok.sum(1), chosen_shift.sum(1))  # for 'sft': the chosen completion's NLL, its tokens
        loss = torch.zeros_like(chosen_logps)
        for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
            per_pair = self._pair_loss(
                loss_type, chosen_logratios, rejected_logratios, chosen_scores, rejected_scores, lengths, chosen_nll
            )
            loss = loss + weight * per_pair
        return loss

    def _sequence_log_probs(self, per_token: torch.Tensor, mask: torch.Tensor, other_mask: torch.Tensor):
        """Summed log-probabilities of each completion; with ``ld_alpha`` (LD-DPO), the tokens beyond the length the
        pair's two completions share weighted by ``ld_alpha`` (per pair, as TRL)."""
        if self.ld_alpha is None:
            return per_token.sum(1)
        position = mask.cumsum(1)
        shared = torch.minimum(mask.sum(1), other_mask.sum(1)).unsqueeze(1)
        shared_mask = (position > 0) & (position <= shared)
        tail_mask = position > shared
        return (per_token * shared_mask).sum(1) + self.ld_alpha * (per_token * tail_mask).sum(1)

    def _f_scores(self, logratios: torch.Tensor) -> torch.Tensor:
        """TRL's f-divergence scores of the log-ratios (element-wise: per pair)."""
        kind = self.f_divergence_type
        if kind == "reverse_kl":
            return logratios
        if kind == "forward_kl":
            return 1 - torch.exp(-logratios)
        if kind == "js_divergence":
            return math.log(2) + F.logsigmoid(logratios)
        if kind == "alpha_divergence":
            alpha = self.f_alpha_divergence_coef
            if abs(alpha - 1.0) < 1e-6:
                return logratios
            t = (alpha - 1.0) * logratios
            clamp_max = {torch.float16: 11.0, torch.bfloat16: 80.0}.get(t.dtype, 80.0)
            return (torch.exp(torch.clamp(t.float(), max=clamp_max)) - 1.0).to(t.dtype) / (alpha - 1.0)
        raise ValueError(f"Unknown f_divergence_type: {kind}")

    def _pair_loss(self, loss_type, chosen_logratios, rejected_logratios, chosen_scores, rejected_scores, lengths, nll):
        """TRL's per-sequence DPO loss of ``loss_type``, for each pair from its own quantities only."""
        beta, smoothing = self.beta, self.label_smoothing
        delta = chosen_scores - rejected_scores
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if loss_type == "ipo":
            ipo_delta = chosen_scores / lengths[0] - rejected_scores / lengths[1]
            return (ipo_delta - 1 / (2 * beta)) ** 2
        if loss_type == "exo_pair":
            epsilon = torch.tensor(smoothing, device=delta.device, dtype=delta.dtype)
            qw, log_qw = torch.sigmoid(beta * delta), F.logsigmoid(beta * delta)
            ql, log_ql = torch.sigmoid(-beta * delta), F.logsigmoid(-beta * delta)
            return qw * (log_qw - torch.log1p(-epsilon)) + ql * (log_ql - torch.log(epsilon))
        if loss_type == "nca_pair":
            chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
            return -F.logsigmoid(chosen_rewards) - 0.5 * (
                F.logsigmoid(-chosen_rewards) + F.logsigmoid(-rejected_rewards)
            )
        if loss_type == "robust":
            clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
            flipped = -smoothing * F.logsigmoid(-beta * delta)
            return (clean - flipped) / (1 - 2 * smoothing)
        if loss_type == "bco_pair":
            return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        if loss_type == "sppo_hard":
            return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        if loss_type == "apo_zero":
            return (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
        if loss_type == "apo_down":
            return torch.sigmoid(beta * chosen_logratios) + (
                1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        if loss_type == "discopop":
            logits = delta * beta
            modulation = torch.sigmoid(logits / self.args.discopop_tau)
            return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        if loss_type == "sigmoid_norm":
            return -F.logsigmoid(beta * (chosen_scores / lengths[0] - rejected_scores / lengths[1]))
        if loss_type == "sft":
            # The NLL of the pair's chosen completion over its own tokens (TRL: over the tokens of the whole batch)
            total, tokens = nll
            if self.args.per_example_loss_reduction == "sum":
                return total
            return total / tokens.clamp(min=1)
        raise ValueError(f"Loss type {loss_type!r} is not computed per pair by DPDPOTrainer.")

    def _self_check(self, inputs: dict[str, Any]) -> None:
        """The engine's per-pair norms against plain autograd on a few pairs (the policy's two passes per pair)."""
        prepared = self._prepare_inputs(inputs)

        def loss_fn(model, batch: dict[str, Any]) -> torch.Tensor:
            return self.compute_per_example_loss(self.policy_log_probs(model, batch), batch)

        with self.compute_loss_context_manager():
            error = self.clipper.self_check(prepared, loss_fn)
        logger.info("hf_dp self-check passed: per-pair norms agree with autograd (max relative error %.2e).", error)

    # ------------------------------------------------------------------ card
    def dp_model_card_section(self, epsilon_plot: str | None = None) -> str:
        """The DP section, whose unit line says the unit is one preference pair."""
        return pair_card_section(super().dp_model_card_section(epsilon_plot=epsilon_plot))


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the initial policy (the default reference model): no gradients, eval mode."""
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()
