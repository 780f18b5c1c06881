"""Per-example losses: entry ``i`` depends on example ``i`` alone (DESIGN §4 rule 1).

HF models' built-in losses average over all tokens of the batch (and ``num_items_in_batch`` across accumulation),
which couples examples; these compute one loss per example from the model's outputs and the batch's label tensors.
Each loss type names the label tensors it reads (:data:`LABEL_NAMES`); ``label_smoothing`` follows the Trainer's
``label_smoothing_factor`` (``(1 - eps) * NLL + eps * mean_k(-log p_k)`` per token, as HF's ``LabelSmoother``),
applied per example.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LABEL_NAMES",
    "call_loss_function",
    "LOSS_TYPES",
    "PER_EXAMPLE_LOSSES",
    "causal_lm_loss",
    "ctc_loss",
    "infer_loss_type",
    "masked_lm_loss",
    "multi_label_classification_loss",
    "multiple_choice_loss",
    "per_example_loss",
    "question_answering_loss",
    "regression_loss",
    "seq2seq_lm_loss",
    "sequence_classification_loss",
    "single_label_classification_loss",
    "target_counts",
    "token_classification_loss",
    "token_loss",
]

IGNORE_INDEX = -100


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}.")


def _float(logits: Tensor) -> Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def token_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` cross-entropy per example over its own labelled positions (``labels != -100``).

    Args:
        logits (`torch.Tensor`): ``[B, T, V]``.
        labels (`torch.Tensor`): ``[B, T]``, ``-100`` where no loss is taken.
        reduction (`str`): ``"mean"`` over the example's own labelled tokens, or ``"sum"``.
        label_smoothing (`float`): the Trainer's ``label_smoothing_factor``.
    """
    _check_reduction(reduction)
    logits = _float(logits)
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(labels.shape)
    total = per_token.sum(1)
    if reduction == "sum":
        return total
    count = (labels != IGNORE_INDEX).sum(1).clamp_min(1)
    return total / count


def causal_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` next-token loss: position ``t`` predicts ``labels[t + 1]`` (the usual shift)."""
    return token_loss(logits[:, :-1, :], labels[:, 1:], reduction=reduction, label_smoothing=label_smoothing)


def masked_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` masked-LM / prompt-infilling loss on the positions whose label is not ``-100`` (no shift)."""
    return token_loss(logits, labels, reduction=reduction, label_smoothing=label_smoothing)


def seq2seq_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` decoder loss of an encoder-decoder model: logits are already aligned with labels (no shift)."""
    return token_loss(logits, labels, reduction=reduction, label_smoothing=label_smoothing)


def token_classification_loss(
    logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0
) -> Tensor:
    """``[B]`` token-classification loss over each example's labelled tokens."""
    return token_loss(logits, labels, reduction=reduction, label_smoothing=label_smoothing)


def _no_smoothing(label_smoothing: float, what: str) -> None:
    if label_smoothing:
        raise ValueError(
            f"`label_smoothing_factor`={label_smoothing} does not apply to {what}. Set `label_smoothing_factor=0`."
        )


def regression_loss(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` squared error of a regression head, averaged over its outputs (HF's ``MSELoss`` is the mean of these
    over the batch: ``problem_type="regression"``)."""
    _no_smoothing(label_smoothing, "a regression head (`problem_type='regression'`)")
    batch = logits.shape[0]
    logits = _float(logits).reshape(batch, -1)
    return (logits - labels.to(logits.dtype).reshape(batch, -1)).pow(2).mean(1)


def multi_label_classification_loss(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` binary cross-entropy with logits, averaged over the labels of each example (HF's
    ``BCEWithLogitsLoss`` is the mean of these over the batch: ``problem_type="multi_label_classification"``)."""
    _no_smoothing(label_smoothing, "multi-label classification (`problem_type='multi_label_classification'`)")
    batch = logits.shape[0]
    logits = _float(logits).reshape(batch, -1)
    targets = labels.to(logits.dtype).reshape(batch, -1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(1)


def sequence_classification_loss(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` loss of a classification head with ``problem_type`` unset, chosen as HF chooses it: squared error for
    one output, cross-entropy for integer labels, else per-label binary cross-entropy (multi-label)."""
    if logits.shape[-1] == 1:
        return regression_loss(logits, labels, label_smoothing=label_smoothing)
    if labels.is_floating_point():
        return multi_label_classification_loss(logits, labels, label_smoothing=label_smoothing)
    return torch.nn.functional.cross_entropy(
        _float(logits), labels.view(-1), reduction="none", label_smoothing=label_smoothing
    )


def single_label_classification_loss(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` cross-entropy of a classification head (``problem_type="single_label_classification"``)."""
    return torch.nn.functional.cross_entropy(
        _float(logits).reshape(logits.shape[0], -1),
        labels.view(-1),
        reduction="none",
        label_smoothing=label_smoothing,
    )


def ctc_loss(
    logits: Tensor,
    labels: Tensor,
    input_lengths: Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> Tensor:
    """``[B]`` CTC loss of each example (speech recognition: ``*ForCTC``), with the semantics of HF's ``ForCTCLoss``.

    Args:
        logits (`torch.Tensor`): ``[B, T, V]`` frame logits.
        labels (`torch.Tensor`): ``[B, U]`` targets, padded with ``-100`` (or the blank id).
        input_lengths (`torch.Tensor`): ``[B]`` valid frames of each example.
        blank (`int`): the blank id (``config.pad_token_id`` in HF's CTC heads).
        reduction (`str`): ``config.ctc_loss_reduction``: ``"mean"`` divides each example's loss by its own target
            length (HF's batch loss is then the mean of these), ``"sum"`` keeps it (HF's batch loss is their sum).
        zero_infinity (`bool`): ``config.ctc_zero_infinity``: an impossible alignment gives 0 (and no gradient).
    """
    _check_reduction(reduction)
    keep = (labels != IGNORE_INDEX) & (labels != blank)
    target_lengths = keep.sum(-1)
    log_probs = torch.nn.functional.log_softmax(_float(logits), dim=-1).transpose(0, 1)
    with torch.backends.cudnn.flags(enabled=False):  # as HF: cuDNN's CTC needs other layouts and dtypes
        loss = torch.nn.functional.ctc_loss(
            log_probs,
            labels.masked_select(keep),
            input_lengths.to(torch.long),
            target_lengths,
            blank=blank,
            reduction="none",
            zero_infinity=zero_infinity,
        )
    if reduction == "mean":
        loss = loss / target_lengths.clamp_min(1).to(loss.dtype)
    return loss


def multiple_choice_loss(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` cross-entropy over the choices (``logits``: ``[B, num_choices]``)."""
    return torch.nn.functional.cross_entropy(
        _float(logits), labels.view(-1), reduction="none", label_smoothing=label_smoothing
    )


def question_answering_loss(
    start_logits: Tensor,
    end_logits: Tensor,
    start_positions: Tensor,
    end_positions: Tensor,
    *,
    label_smoothing: float = 0.0,
) -> Tensor:
    """``[B]`` extractive-QA loss: the mean of the start and end cross-entropies of each example.

    As in HF's QA heads, positions outside the sequence are clamped to ``T`` and then ignored (that term is 0).
    """
    length = start_logits.shape[1]

    def span_loss(logits: Tensor, positions: Tensor) -> Tensor:
        positions = positions.reshape(-1).clamp(0, length)
        return torch.nn.functional.cross_entropy(
            _float(logits), positions, ignore_index=length, reduction="none", label_smoothing=label_smoothing
        )

    return (span_loss(start_logits, start_positions) + span_loss(end_logits, end_positions)) / 2


def _logits(outputs: Any, name: str = "logits") -> Tensor:
    if isinstance(outputs, Mapping):
        if name not in outputs:
            raise ValueError(f"The model's outputs have no `{name}` (keys: {sorted(outputs)}).")
        return outputs[name]
    return outputs[0] if name in ("logits", "start_logits") else outputs[1]


def _virtual_tokens(model) -> int:
    """How many virtual tokens a prompt-learning PEFT model puts before the input tokens, where its outputs have a
    position for each: prompt tuning, p-tuning, CPT (not prefix tuning, whose prefix is in the attention's keys and
    values only); 0 for any other model."""
    model = getattr(model, "module", model)  # DDP / DataParallel
    config = getattr(model, "active_peft_config", None)
    if not getattr(config, "is_prompt_learning", False) or config.peft_type in ("PREFIX_TUNING", "CARTRIDGE"):
        return 0
    return int(getattr(config, "num_virtual_tokens", 0) or 0)


def _aligned_labels(logits: Tensor, labels: Tensor, model) -> Tensor:
    """``labels`` with ``-100`` for the virtual tokens of a prompt-learning PEFT model in front, as peft itself pads
    them for the base model's own loss, when the logits have a position for each (else ``labels`` unchanged)."""
    n = _virtual_tokens(model)
    if n and labels.dim() >= 2 and logits.dim() >= 3 and logits.shape[1] == labels.shape[1] + n:
        pad = labels.new_full((labels.shape[0], n, *labels.shape[2:]), IGNORE_INDEX)
        return torch.cat([pad, labels], 1)
    return labels


def _token_type_loss(fn):
    def loss(outputs, labels, *, reduction, label_smoothing, model=None, **context):
        logits = _logits(outputs)
        labels = _aligned_labels(logits, labels["labels"], model)
        return fn(logits, labels, reduction=reduction, label_smoothing=label_smoothing)

    return loss


def _head_loss(fn):
    def loss(outputs, labels, *, reduction, label_smoothing, **context):
        return fn(_logits(outputs), labels["labels"], label_smoothing=label_smoothing)

    return loss


def _causal(outputs, labels, *, reduction, label_smoothing, model=None, **context):
    logits = _logits(outputs)
    if "shift_labels" in labels:  # labels already shifted by the collator: no second shift
        shifted = _aligned_labels(logits, labels["shift_labels"], model)
        return token_loss(logits, shifted, reduction=reduction, label_smoothing=label_smoothing)
    aligned = _aligned_labels(logits, labels["labels"], model)
    return causal_lm_loss(logits, aligned, reduction=reduction, label_smoothing=label_smoothing)


def _span(outputs, labels, *, reduction, label_smoothing, **context):
    return question_answering_loss(
        _logits(outputs, "start_logits"),
        _logits(outputs, "end_logits"),
        labels["start_positions"],
        labels["end_positions"],
        label_smoothing=label_smoothing,
    )


def _base_model(model):
    if model is None:
        return None
    model = getattr(model, "module", model)  # DDP / DataParallel
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _ctc(outputs, labels, *, reduction, label_smoothing, model=None, inputs=None, **context):
    """CTC with the model's own settings: blank ``config.pad_token_id``, ``config.ctc_loss_reduction``,
    ``config.ctc_zero_infinity``; frames per example from the attention mask through the model's
    ``_get_feat_extract_output_lengths`` (all frames without a mask). ``per_example_loss_reduction`` does not apply:
    ``ctc_loss_reduction`` is the model's."""
    _no_smoothing(label_smoothing, "a CTC loss")
    base = _base_model(model)
    if base is None or getattr(base, "config", None) is None:
        raise ValueError(
            "The 'ctc' per-example loss needs the model (its `config.pad_token_id`, `ctc_loss_reduction`, "
            "`ctc_zero_infinity` and `_get_feat_extract_output_lengths`): pass `model=` to `per_example_loss`."
        )
    config = base.config
    logits = _logits(outputs)
    mask = None if inputs is None else inputs.get("attention_mask")
    if mask is None:
        lengths = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long, device=logits.device)
    else:
        lengths = base._get_feat_extract_output_lengths(mask.sum(-1)).to(device=logits.device, dtype=torch.long)
    blank = config.pad_token_id if config.pad_token_id is not None else 0
    return ctc_loss(
        logits,
        labels["labels"].to(logits.device),
        lengths,
        blank=blank,
        reduction=getattr(config, "ctc_loss_reduction", "sum"),
        zero_infinity=bool(getattr(config, "ctc_zero_infinity", False)),
    )


#: loss_type -> function(outputs, labels: dict, *, reduction, label_smoothing) returning ``[B]``.
PER_EXAMPLE_LOSSES = {
    "causal_lm": _causal,
    "masked_lm": _token_type_loss(masked_lm_loss),
    "seq2seq_lm": _token_type_loss(seq2seq_lm_loss),
    "sequence_classification": _head_loss(sequence_classification_loss),
    "single_label_classification": _head_loss(single_label_classification_loss),
    "multi_label_classification": _head_loss(multi_label_classification_loss),
    "regression": _head_loss(regression_loss),
    "token_classification": _token_type_loss(token_classification_loss),
    "question_answering": _span,
    "multiple_choice": _head_loss(multiple_choice_loss),
    "ctc": _ctc,
}
#: loss_type -> the label tensors it reads (``causal_lm`` also reads ``shift_labels`` when the batch has them).
LABEL_NAMES: dict[str, tuple[str, ...]] = {
    "causal_lm": ("labels",),
    "masked_lm": ("labels",),
    "seq2seq_lm": ("labels",),
    "sequence_classification": ("labels",),
    "single_label_classification": ("labels",),
    "multi_label_classification": ("labels",),
    "regression": ("labels",),
    "token_classification": ("labels",),
    "question_answering": ("start_positions", "end_positions"),
    "multiple_choice": ("labels",),
    "ctc": ("labels",),
}
LOSS_TYPES = sorted(PER_EXAMPLE_LOSSES)
#: Loss types over an example's target tokens (label ``-100``: not a target): an example without one adds nothing.
TOKEN_LOSS_TYPES = ("causal_lm", "masked_lm", "seq2seq_lm", "token_classification", "ctc")


def call_loss_function(function: Callable[..., Tensor], outputs: Any, labels: Any) -> Tensor:
    """``function(outputs, labels)``; with transformers' signature ``(outputs, labels, num_items_in_batch)``, its
    third argument is `None`: a count of tokens over the whole (logical) batch would couple the examples, so hf_dp
    never gives one (the function must return one loss per example)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return function(outputs, labels)
    if "num_items_in_batch" in parameters:
        return function(outputs, labels, num_items_in_batch=None)
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 and positional[2].default is inspect.Parameter.empty:
        return function(outputs, labels, None)
    return function(outputs, labels)


def target_counts(loss_type: str, labels: Mapping[str, Tensor]) -> Tensor | None:
    """``[B]``: how many tokens of each example the loss of ``loss_type`` learns from (for causal LM, the labels after
    the one-token shift); `None` for a loss with one target per example, or a batch without its label tensor."""
    if loss_type not in TOKEN_LOSS_TYPES:
        return None
    if loss_type == "causal_lm" and "shift_labels" in labels:
        targets = labels["shift_labels"]
    elif "labels" not in labels or not isinstance(labels["labels"], Tensor) or labels["labels"].dim() < 2:
        return None
    else:
        targets = labels["labels"][:, 1:] if loss_type == "causal_lm" else labels["labels"]
    return (targets != IGNORE_INDEX).reshape(targets.shape[0], -1).sum(1)


def per_example_loss(
    loss_type: str,
    outputs: Any,
    labels: Mapping[str, Tensor],
    *,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    model: Any = None,
    inputs: Mapping[str, Any] | None = None,
) -> Tensor:
    """``[B]`` loss of ``loss_type`` from the model's ``outputs`` and the batch's label tensors.

    ``model`` and ``inputs`` (the whole batch) are read by the losses that need them: ``ctc`` takes its blank id and
    reduction from ``model.config`` and its frame counts from ``inputs["attention_mask"]``; the token losses give the
    virtual tokens of a prompt-learning PEFT model (prompt tuning, p-tuning, CPT), which have logits but no labels,
    the label ``-100``, as peft does for the base model's own loss.

    Raises:
        ValueError: an unknown loss type, or a label tensor the loss type needs is missing from the batch.
    """
    if loss_type not in PER_EXAMPLE_LOSSES:
        raise ValueError(f"Unknown `loss_type` {loss_type!r}. Choose one of {LOSS_TYPES}.")
    missing = [name for name in LABEL_NAMES[loss_type] if name not in labels and name != "labels"]
    if "labels" in LABEL_NAMES[loss_type] and "labels" not in labels and "shift_labels" not in labels:
        missing.append("labels")
    if missing:
        raise ValueError(
            f"The {loss_type!r} per-example loss needs {missing} in every batch (got {sorted(labels)}); add them in "
            "the data collator (e.g. DataCollatorForLanguageModeling for a causal LM), or set `label_names`."
        )
    return PER_EXAMPLE_LOSSES[loss_type](
        outputs, labels, reduction=reduction, label_smoothing=label_smoothing, model=model, inputs=inputs
    )


_CLASS_SUFFIXES = (
    ("ForConditionalGeneration", "seq2seq_lm"),
    ("ForQuestionAnswering", "question_answering"),
    ("ForMultipleChoice", "multiple_choice"),
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForCTC", "ctc"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForImageClassification", "sequence_classification"),
    ("ForAudioClassification", "sequence_classification"),
    ("ForVideoClassification", "sequence_classification"),
    ("ForTokenClassification", "token_classification"),
)
#: ``config.problem_type`` of a classification head -> its loss type (the same names).
_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def infer_loss_type(model) -> str:
    """The per-example loss for a model, from its class name (PEFT models: their base model); classification heads
    (``*ForSequenceClassification``, ``*ForImageClassification``, ``*ForAudioClassification``,
    ``*ForVideoClassification``) follow ``config.problem_type`` when it is set, and HF's own choice from the labels
    when it is not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) == "xlnet" and "LMHeadModel" in name:
        raise ValueError(
            f"{name} trains with XLNet's permutation language modelling (`perm_mask`, `target_mapping`: logits "
            "aligned with `labels`, no shift), not a shifted causal LM: hf_dp does not infer its loss. Set "
            "`dp_loss_type='masked_lm'` (the loss on the positions whose label is not -100, no shift) after "
            "checking that it matches your data collator, or pass `compute_loss_func(outputs, labels)`."
        )
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    for suffix, loss_type in _CLASS_SUFFIXES:
        if suffix in name and (loss_type != "seq2seq_lm" or encoder_decoder):
            if loss_type == "sequence_classification":
                problem_type = getattr(config, "problem_type", None)
                if problem_type in _PROBLEM_TYPES:
                    return problem_type
            return loss_type
    if encoder_decoder:
        return "seq2seq_lm"
    raise ValueError(
        f"Cannot tell which per-example loss {name} needs. Set `dp_loss_type` in DPTrainingArguments to one of "
        f"{LOSS_TYPES}, or pass `compute_loss_func(outputs, labels)` returning one loss per example."
    )
