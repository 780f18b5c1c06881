"""``DPSFTTrainer``: TRL's supervised fine-tuning with DP training (its config: :mod:`.sft_config`; the DPO pair:
:mod:`.dpo_config`, :mod:`.dpo_trainer`).

TRL's ``sft.py`` changes three names: ``SFTConfig`` -> ``DPSFTConfig``, ``SFTTrainer`` -> ``DPSFTTrainer`` and the
import. Everything else is TRL's: the model given as a Hub id or path (``model_init_kwargs``), ``peft_config``,
``formatting_func``, the dataset formats (``text``, prompt-completion, conversational ``messages``) and the loss masks
TRL builds into ``labels`` (``completion_only_loss``, ``assistant_only_loss``), the collator, gradient checkpointing.
The training step is hf_dp's (:class:`~hf_dp.trainers.mixin.DPTrainerMixin`): Poisson sampling, one loss per
example (the example's own next-token loss over the tokens whose label is not ``-100``, never a batch mean), book-kept
clipping, Gaussian noise, accounting and the DP model card.

This module imports TRL; ``import hf_dp`` does not (``hf_dp.DPSFTTrainer`` imports it on first use). Install it with
``pip install 'hf_dp[trl]'``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..losses import IGNORE_INDEX, _float
from ..packed_sequences import packed_causal_lm_loss, packed_sequence_ids
from ..sampling.packing import PackedSequenceCollator
from .mixin import DPTrainerMixin
from .sft_config import DPSFTConfig, check_sft_fields, packs_sequences
from .trl_common import UNIT_ROW, SFTTrainer, prepare_trl_init, quiet_model_init_kwargs_warning

logger = logging.getLogger("hf_dp")

__all__ = ["DPSFTTrainer"]

#: Attention implementations with which transformers keeps the sequences of a padding-free row apart (a block-causal
#: mask from the restarting `position_ids`), as hf_dp's tests check against each sequence run alone.
PACKED_ATTENTION = ("eager", "sdpa")

_PACKED_UNIT_ROW = (
    "| Unit of privacy | one packed row of `max_length` tokens (TRL `packing_strategy='wrapped'`): a row of the "
    "packed training set, not one original document (adding or removing a document re-cuts every later row, so no "
    "per-document guarantee follows) |"
)
_SEQUENCE_UNIT_ROW = (
    "| Unit of privacy | one sequence: one example of the training set (TRL's padding-free packing, "
    "`packing_strategy='bfd'`: the sequences are Poisson-sampled, packed into rows after sampling, and each is clipped "
    "on its own) |"
)


class _SFTTrainerInit(SFTTrainer):
    """Takes the Trainer's arguments from :class:`DPTrainerMixin` and adds SFTTrainer's own (``peft_config``,
    ``formatting_func``, ``quantization_config``), set by :class:`DPSFTTrainer` before."""

    def __init__(self, *, model_init=None, **kwargs):  # model_init: always None (refused by DPTrainerMixin)
        extra = self.__dict__.pop("_dp_sft_init_kwargs", {})
        super().__init__(**kwargs, **extra)


class DPSFTTrainer(DPTrainerMixin, _SFTTrainerInit):
    """Drop-in replacement for TRL's :class:`~trl.SFTTrainer` that trains with (epsilon, delta)-differential privacy.

    Takes SFTTrainer's arguments (``model`` as a Hub id, a local path or a model object; ``peft_config``;
    ``formatting_func``; ``quantization_config``; ...) with ``args`` a :class:`DPSFTConfig`. Every TRL dataset format
    works: language modeling (``text``), prompt-completion (``completion_only_loss``, on by default for it),
    conversational (``messages``, with ``assistant_only_loss``), and ``formatting_func``. The per-example loss is the
    example's own next-token loss over the tokens TRL's preparation keeps in ``labels`` (``-100`` elsewhere: the prompt
    with completion-only loss, non-assistant turns with assistant-only loss, padding), averaged over those tokens
    (``per_example_loss_reduction="mean"``) or summed, never over the batch. ``loss_type="dft"`` is TRL's DFT loss
    (each token's NLL weighted by its detached probability), per example in the same way.

    Unit of privacy: one example of the training set TRL prepares. With ``packing=True`` and TRL's default
    ``packing_strategy="bfd"`` (or ``padding_free=True``) that is still one sequence: hf_dp Poisson-samples the
    un-packed sequences (truncated to ``max_length`` as bfd truncates them; q, the expected batch size and
    ``per_device_train_batch_size`` count sequences), TRL's padding-free collator packs the sequences of each
    micro-batch into one row (``position_ids`` restarting at each sequence), and each sequence is clipped on its own
    inside the row (:mod:`hf_dp.engine.packed`). The model's attention must keep the sequences apart: 'eager' or
    'sdpa' attention, checked on the first micro-batch with two sequences (no sequence's loss may reach another's
    tokens) and by comparing a few packed sequences with themselves run alone (this check runs whatever
    ``dp_self_check`` says). With ``packing_strategy="wrapped"`` the unit is one packed row of ``max_length`` tokens:
    the guarantee is then with respect to the packed rows, not the original documents (a document cut over several
    rows, or the addition or removal of one document, which re-cuts every later row, is not covered as one unit). The
    model card's unit line says which. With ``privacy_unit="user"`` the unit is every row of one user (the user
    column passes through TRL's preparation); packing is then refused, since a packed row mixes users.

    Training metrics TRL logs from the training batches (``entropy``, ``mean_token_accuracy``, ``num_tokens``) are
    not computed during DP steps (they would be un-noised statistics of the training data); evaluation is TRL's
    (``eval_loss`` is SFTTrainer's, with its metrics).

    Raises:
        ValueError: before training, for any setting that would break the guarantee.

    Example:
        ```python
        from hf_dp import DPSFTConfig, DPSFTTrainer   # was: from trl import SFTConfig, SFTTrainer

        args = DPSFTConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=1.0,
                           per_device_train_batch_size=16, gradient_accumulation_steps=16, learning_rate=1e-3)
        trainer = DPSFTTrainer(model="Qwen/Qwen2.5-0.5B", args=args, train_dataset=dataset,
                               peft_config=LoraConfig(r=16, target_modules="all-linear"))
        trainer.train()
        ```
    """

    _dp_arguments_class = DPSFTConfig

    def __init__(
        self,
        model: Any,
        args: DPSFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
        formatting_func: Callable[[dict], str] | None = None,
    ):
        args, model, processing_class, quantization_config, loaded_from = prepare_trl_init(
            "DPSFTTrainer",
            DPSFTConfig,
            check_sft_fields,
            args,
            model,
            train_dataset,
            quantization_config,
            processing_class,
        )
        self._dp_sft_init_kwargs = {
            "quantization_config": quantization_config,
            "peft_config": peft_config,
            "formatting_func": formatting_func,
        }
        # padding-free packing: sequences sampled and clipped one by one (fixed now: the training set is prepared so)
        self._dp_packs_sequences = packs_sequences(args)
        self._packed_check_pending = False
        with quiet_model_init_kwargs_warning(loaded_from is not None):
            super().__init__(
                model=model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                compute_loss_func=compute_loss_func,
                compute_metrics=compute_metrics,
                callbacks=callbacks,
                optimizers=optimizers,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            )
        if self._dp_packs_sequences:  # TRL's padding-free collator, declared as packing sequences clipped one by one
            self.data_collator = PackedSequenceCollator(self.data_collator)

    # ------------------------------------------------------------------ padding-free packing
    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's preparation; with padding-free packing the training set is left un-packed (one sequence a row,
        truncated to ``max_length`` as bfd truncates): the sampler draws sequences, the collator packs them."""
        if dataset_name == "train" and packs_sequences(args):
            packing = False
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    def _clipping_policy_kwargs(self) -> dict[str, Any]:
        kwargs = super()._clipping_policy_kwargs()
        if self._dp_packs_sequences:
            kwargs["packed_sequences"] = True
        return kwargs

    def train(self, *args, **kwargs):
        """``DPTrainerMixin.train``; with padding-free packing, the attention implementation checked first and the
        per-sequence self-check scheduled (whatever ``dp_self_check`` says)."""
        if packs_sequences(self.args) != self._dp_packs_sequences:
            raise ValueError(
                "`packing`/`padding_free` changed after the trainer was built (its training set was prepared for "
                "the old setting). Build a new DPSFTTrainer."
            )
        if self._dp_packs_sequences:
            _check_packed_attention(self.model)
            self._packed_check_pending = True
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        if self._packed_check_pending:  # until a micro-batch of two sequences or more has been checked
            self._needs_self_check = True
        return super().training_step(model, inputs, num_items_in_batch)

    def _self_check(self, inputs: dict[str, Any]) -> None:
        """With padding-free packing: each of a few packed sequences against itself run alone (deferred to the first
        micro-batch of two sequences or more, where one sequence could see another)."""
        if not self._dp_packs_sequences:
            return super()._self_check(inputs)
        position_ids = inputs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and int(packed_sequence_ids(position_ids).max()) < 1:
            logger.info("hf_dp: the packed self-check waits for a micro-batch of two sequences or more.")
            return None
        super()._self_check(inputs)
        self._packed_check_pending = False
        return None

    # ------------------------------------------------------------------ loss
    def _row_target_count(self, row) -> int | None:
        """The tokens a prepared row learns from: its labels, or (TRL builds them in the collator) its tokens after
        the first kept by `completion_mask` (with completion-only loss) and `assistant_masks`."""
        count = super()._row_target_count(row)
        if count is not None or not isinstance(row, Mapping) or "input_ids" not in row:
            return count
        keep = torch.ones(len(row["input_ids"]), dtype=torch.bool)
        if getattr(self, "completion_only_loss", False) and "completion_mask" in row:
            keep &= torch.as_tensor(row["completion_mask"]).bool()
        if "assistant_masks" in row:
            keep &= torch.as_tensor(row["assistant_masks"]).bool()
        return int(keep[1:].sum())

    def _model_inputs(self, model, inputs):
        """The batch without labels, and ``use_cache=False`` (as SFTTrainer: no cache while training)."""
        model_inputs = super()._model_inputs(model, inputs)
        model_inputs.setdefault("use_cache", False)
        return model_inputs

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]``: the next-token loss of each example over its own labelled tokens (``nll``), or TRL's DFT loss
        (``dft``: each token's NLL times its detached probability), reduced per example; with padding-free packing
        ``[S]``, one per sequence of the packed rows."""
        if self._dp_packs_sequences and self.compute_loss_func is None:
            logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
            dft = self.args.loss_type == "dft"
            return packed_causal_lm_loss(
                logits,
                inputs["labels"],
                inputs["position_ids"],
                reduction=self.args.per_example_loss_reduction,
                label_smoothing=0.0 if dft else self.args.label_smoothing_factor,
                token_weight=(lambda nll: nll * torch.exp(-nll).detach()) if dft else None,
            )
        if self.args.loss_type != "dft" or self.compute_loss_func is not None:
            return super().compute_per_example_loss(outputs, inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        labels = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
        if "shift_labels" not in inputs:
            logits = logits[:, :-1]
        logits = _float(logits)
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(labels.shape)
        per_token = nll * torch.exp(-nll).detach()  # DFT (arXiv 2508.05629); zero on ignored positions
        total = per_token.sum(1)
        if self.args.per_example_loss_reduction == "sum":
            return total
        return total / (labels != IGNORE_INDEX).sum(1).clamp_min(1)

    # ------------------------------------------------------------------ card
    def dp_model_card_section(self, epsilon_plot: str | None = None) -> str:
        """The DP section; its unit line says a sequence with padding-free packing, a packed row with wrapped
        packing."""
        section = super().dp_model_card_section(epsilon_plot=epsilon_plot)
        if self._dp_packs_sequences:
            section = section.replace(UNIT_ROW, _SEQUENCE_UNIT_ROW)
        elif self.args.packing:
            section = section.replace(UNIT_ROW, _PACKED_UNIT_ROW)
        return section


def _check_packed_attention(model) -> None:
    """Padding-free packing needs an attention implementation that builds its mask from the restarting
    ``position_ids`` (:data:`PACKED_ATTENTION`); others are refused before training."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        raise ValueError(
            f"Padding-free packing with `attn_implementation={implementation!r}`: hf_dp has checked that "
            f"{list(PACKED_ATTENTION)} keep the sequences of a packed row apart (a block-causal mask from the "
            "restarting `position_ids`), not this one. Load the model with `attn_implementation='sdpa'` (in "
            "`model_init_kwargs`), or set `packing=False`."
        )
