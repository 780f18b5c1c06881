"""What :class:`~hf_dp.trainers.orpo_trainer.DPORPOTrainer` and :class:`~hf_dp.trainers.cpo_trainer.DPCPOTrainer`
share: TRL's reference-free preference trainers (``trl.experimental.orpo``, ``trl.experimental.cpo``: imported here),
the settings both refuse, and the DP step's forward.

TRL's collator for them (``DPODataCollatorWithPadding``) returns one row per pair, with the pair's chosen and rejected
sequences under their own keys (``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_labels``: the prompt
and padding labelled ``-100``; the same for ``rejected_*``), and TRL runs the policy once on their concatenation (a
``[2B, T]`` batch). A DP step instead runs the policy twice, on the ``B`` chosen sequences and on the ``B`` rejected
ones (both passes book-kept: the per-pair gradient norm includes the cross terms between them), so that each pair's
loss depends on that pair alone. The model is never called on the collator's batch as it is (``model(**batch)``: it
has no ``input_ids``), which is why the mixin alone, composed over ``ORPOTrainer``, failed on its first forward.

Both modules import this one, never each other. It imports TRL's experimental trainers (APIs TRL may change without
notice); ``import hf_dp`` and ``import hf_dp.trl`` do not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..losses import IGNORE_INDEX
from .mixin import DPTrainerMixin
from .trl_common import pair_card_section, prepare_trl_init

try:
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
except ImportError as error:  # pragma: no cover - a TRL without them
    import trl as _trl

    raise ImportError(
        "DPORPOTrainer and DPCPOTrainer are TRL's ORPOTrainer and CPOTrainer (`trl.experimental.orpo`, "
        f"`trl.experimental.cpo`), which TRL {_trl.__version__} does not have: install a TRL that ships them "
        "(trl 1.16 does)."
    ) from error

__all__ = [
    "CPOConfig",
    "CPOTrainer",
    "DPPairPolicyMixin",
    "ORPOConfig",
    "ORPOTrainer",
    "check_pair_policy_fields",
    "sequence_log_probs",
]

#: The keys of TRL's paired batch the DP step reads (one row per pair).
PAIR_KEYS = tuple(
    f"{side}_{key}" for side in ("chosen", "rejected") for key in ("input_ids", "attention_mask", "labels")
)


def check_pair_policy_fields(args, trainer: str) -> None:
    """The ORPO/CPO settings DP training refuses, each with what to set instead."""
    if args.dp_loss_type != "causal_lm":
        raise ValueError(
            f"`dp_loss_type={args.dp_loss_type!r}`: {trainer}'s per-example loss is the loss of each preference pair "
            "(TRL's); leave `dp_loss_type` at its default, 'causal_lm'."
        )
    if args.is_encoder_decoder:
        raise ValueError(
            f"{trainer} does not support encoder-decoder models yet (`is_encoder_decoder=True`): its paired passes "
            "are checked for decoder-only models. Use a causal language model."
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            f"{trainer} does not support FSDP yet (the paired forward passes have not been checked under sharding). "
            "Train on one process, or with plain data parallelism."
        )


def sequence_log_probs(per_token: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """``[B]``: each sequence's log-probabilities of its ``mask`` tokens (``per_token`` is zero elsewhere), summed or
    averaged over that sequence's own tokens."""
    total = per_token.sum(1)
    return total / mask.sum(1).clamp(min=1) if average else total


@contextlib.contextmanager
def _model_init_kwargs_used(args, active: bool):
    """ORPO's and CPO's ``__init__`` refuse ``model_init_kwargs`` with a model object; the DP trainer loaded the model
    with them (``active``): hidden from TRL's ``__init__`` only, then given back."""
    saved = args.model_init_kwargs
    if active:
        args.model_init_kwargs = None
    try:
        yield
    finally:
        args.model_init_kwargs = saved


class DPPairPolicyMixin(DPTrainerMixin):
    """:class:`DPTrainerMixin` with ORPO's and CPO's constructor, paired forward and card; each trainer adds its
    config class, its field checks (``_check_fields``) and its per-pair loss (``compute_per_example_loss``)."""

    #: ``check(args)``: the trainer's own refusals (run again at construction: the arguments may have changed).
    _check_fields: Callable[[Any], None] = staticmethod(lambda args: None)
    #: Whether the loss reads the log-probabilities of every attended token of the chosen sequence (ORPO's NLL).
    _chosen_sequence_logps = False

    def __init__(
        self,
        model: Any,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config=None,
        compute_metrics: Callable | None = None,
    ):
        from transformers import AutoModelForCausalLM

        args, model, processing_class, _, loaded_from = prepare_trl_init(
            type(self).__name__,
            self._dp_arguments_class,
            type(self)._check_fields,
            args,
            model,
            train_dataset,
            None,
            processing_class,
            architecture=AutoModelForCausalLM,
        )
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise ValueError(
                f"{type(self).__name__} does not support encoder-decoder models yet ({type(model).__name__}): its "
                "paired passes are checked for decoder-only models. Use a causal language model."
            )
        with _model_init_kwargs_used(args, loaded_from is not None):
            super().__init__(
                model=model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                model_init=model_init,
                callbacks=callbacks,
                optimizers=optimizers,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                peft_config=peft_config,
                compute_metrics=compute_metrics,
            )
        if hasattr(self.args, "loss_type"):
            # CPOTrainer reads `self.loss_type` (TRL's loss, in evaluation too), which DPTrainerMixin set to hf_dp's
            # per-example loss type; these trainers' per-example loss is their own (compute_per_example_loss)
            self.loss_type = self.args.loss_type

    def dp_forward(self, model, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The policy's per-token log-probabilities (``[B, T-1]``, zero elsewhere) of each pair's chosen and rejected
        completion tokens (label not ``-100``), from two forward passes of ``B`` rows; with
        ``_chosen_sequence_logps``, also those of every attended token of the chosen sequence."""
        missing = [key for key in PAIR_KEYS if key not in inputs]
        if missing:
            raise ValueError(
                f"{type(self).__name__} expects the batches of TRL's paired collator (`DPODataCollatorWithPadding`), "
                f"which have {list(PAIR_KEYS)}; this batch has no {missing} (keys {sorted(inputs)})."
            )
        out = {}
        for side in ("chosen", "rejected"):
            ids, mask = inputs[f"{side}_input_ids"], inputs[f"{side}_attention_mask"]
            outputs = model(input_ids=ids, attention_mask=mask, use_cache=False)
            logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
            # Prompt-learning PEFT prepends virtual tokens to the outputs: keep the positions of the real tokens
            logits = logits[:, -ids.shape[1] :][:, :-1]
            logps = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
            labels = inputs[f"{side}_labels"][:, 1:]
            completion = labels != IGNORE_INDEX
            out[f"{side}_logps"] = logps.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * completion
            if side == "chosen" and self._chosen_sequence_logps:
                attended = mask[:, 1:] == 1
                out["chosen_sequence_logps"] = logps.gather(-1, ids[:, 1:, None])[..., 0] * attended
        return out

    def _row_target_count(self, row) -> int | None:
        """A prepared pair's completion tokens (the fewer of its chosen and rejected ones): a training set whose pairs
        all have an empty completion is refused before training."""
        if not isinstance(row, Mapping) or "chosen_labels" not in row or "rejected_labels" not in row:
            return None
        return min(sum(label != IGNORE_INDEX for label in row[f"{side}_labels"][1:]) for side in ("chosen", "rejected"))

    def dp_model_card_section(self, epsilon_plot: str | None = None) -> str:
        """The DP section, whose unit line says the unit is one preference pair."""
        return pair_card_section(super().dp_model_card_section(epsilon_plot=epsilon_plot))
