"""DP trainers for TRL: :class:`DPSFTTrainer` / :class:`DPSFTConfig` (supervised fine-tuning), and
:class:`DPDPOTrainer` / :class:`DPDPOConfig` (preference optimisation, in :mod:`hf_dp.trl_dpo`).

TRL's ``sft.py`` changes three names: ``SFTConfig`` -> ``DPSFTConfig``, ``SFTTrainer`` -> ``DPSFTTrainer`` and the
import. Everything else is TRL's: the model given as a Hub id or path (``model_init_kwargs``), ``peft_config``,
``formatting_func``, the dataset formats (``text``, prompt-completion, conversational ``messages``) and the loss masks
TRL builds into ``labels`` (``completion_only_loss``, ``assistant_only_loss``), the collator, gradient checkpointing.
The training step is hf_dp's (:class:`~hf_dp.core.DPTrainerMixin`): Poisson sampling, one loss per example (the
example's own next-token loss over the tokens whose label is not ``-100``, never a batch mean), book-kept clipping,
Gaussian noise, accounting and the DP model card.

This module imports TRL; ``import hf_dp`` does not (``hf_dp.DPSFTTrainer`` imports it on first use). Install it with
``pip install 'hf_dp[trl]'``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import trl as _trl
    from trl import SFTConfig, SFTTrainer
except ImportError as error:  # pragma: no cover - exercised in an environment without TRL
    raise ImportError(
        "hf_dp's TRL trainers (DPSFTTrainer, DPSFTConfig, DPDPOTrainer, DPDPOConfig) need TRL: install it with "
        "`pip install 'hf_dp[trl]'` (trl>=1.0)."
    ) from error

from packaging.version import Version

from .arguments import _DP_PARAMETERS_DOC, DPArgumentsMixin
from .core import DPTrainerMixin
from .losses import IGNORE_INDEX, LOSS_TYPES

if Version(_trl.__version__) < Version("1.0"):  # pragma: no cover
    raise ImportError(f"hf_dp's TRL trainers need trl>=1.0, found {_trl.__version__}: `pip install 'hf_dp[trl]'`.")

logger = logging.getLogger("hf_dp")

__all__ = ["DPSFTConfig", "DPSFTTrainer"]  # and DPDPOConfig, DPDPOTrainer (module __getattr__)

#: Served by :mod:`hf_dp.trl_dpo` (imported on first use: it imports this module).
_DPO_NAMES = ("DPDPOConfig", "DPDPOTrainer")


def __getattr__(name: str):
    if name in _DPO_NAMES:
        from . import trl_dpo

        return getattr(trl_dpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: TRL SFT loss types hf_dp computes per example (each is a per-token loss; TRL's batch-level token mean is replaced
#: by the example's own reduction, ``per_example_loss_reduction``).
SFT_LOSS_TYPES = ("nll", "dft")
#: Packing strategies that put several sequences into one padding-free row (refused: clipped as one example).
PADDING_FREE_PACKING = ("bfd", "bfd_split")

_UNIT_ROW = "| Unit of privacy | one training example (one row of the training set) |"
_PACKED_UNIT_ROW = (
    "| Unit of privacy | one packed row of `max_length` tokens (TRL `packing_strategy='wrapped'`): a row of the "
    "packed training set, not one original document (adding or removing a document re-cuts every later row, so no "
    "per-document guarantee follows) |"
)


def _check_sft_fields(args) -> None:
    """The SFTConfig settings DP training refuses, each with what to set instead."""
    if args.loss_type in LOSS_TYPES or args.loss_type == "auto":
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is an hf_dp per-example loss name, but in DPSFTConfig `loss_type` is "
            f"TRL's field ({list(SFT_LOSS_TYPES)}). Set hf_dp's per-example loss with `dp_loss_type` (SFT always uses "
            "'causal_lm')."
        )
    if args.loss_type not in SFT_LOSS_TYPES:
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is not supported by DPSFTTrainer: hf_dp computes one loss per example, "
            f"and does so for TRL's {list(SFT_LOSS_TYPES)} (per-token losses reduced over each example's own tokens)."
        )
    if args.dp_loss_type != "causal_lm":
        raise ValueError(
            f"`dp_loss_type={args.dp_loss_type!r}`: supervised fine-tuning trains a causal LM, whose per-example loss "
            "is the next-token loss (`dp_loss_type='causal_lm'`, the default of DPSFTConfig)."
        )
    if args.packing and args.packing_strategy in PADDING_FREE_PACKING:
        raise ValueError(
            f"`packing=True` with `packing_strategy={args.packing_strategy!r}` packs several sequences into one "
            "padding-free row (TRL turns `padding_free` on for it), which DP training would clip as one example while "
            "the accountant counts each sequence. Set `packing_strategy='wrapped'` (each packed row of `max_length` "
            "tokens is then one example: the privacy unit is a packed row), or `packing=False`."
        )
    if args.packing and args.privacy_unit == "user":
        raise ValueError(
            "`packing=True` with `privacy_unit='user'`: packing concatenates the rows of different users into one "
            "packed row (and drops the user column), so no row would belong to one user. Set `packing=False` "
            "for user-level DP (each row then stays one user's)."
        )
    if args.padding_free:
        raise ValueError(
            "`padding_free=True` concatenates the micro-batch into one row, which DP training would clip as one "
            "example. Set `padding_free=False` (the per-example clipping needs one row per example)."
        )
    if args.activation_offloading:
        raise ValueError(
            "`activation_offloading=True` is not supported by DPSFTTrainer yet: TRL's offloading moves the tensors "
            "autograd saves to the CPU, and hf_dp has not checked its book-keeping (and its self-check) against it "
            "(it needs a GPU). Set `activation_offloading=False`; gradient checkpointing is supported."
        )
    if args.loss_type == "dft" and args.label_smoothing_factor > 0:
        raise ValueError(
            "`loss_type='dft'` with `label_smoothing_factor > 0`: TRL's DFT loss has no label smoothing (it would be "
            "ignored). Set `label_smoothing_factor=0`, or use `loss_type='nll'`."
        )


@dataclass
class DPSFTConfig(DPArgumentsMixin, SFTConfig):
    __doc__ = (
        "Configuration for [`DPSFTTrainer`]: every field of TRL's [`~trl.SFTConfig`] (with TRL's defaults and "
        "meanings, `loss_type` included: `'nll'` or `'dft'`), plus the DP fields below.\n\n"
        "    Refused, with what to set instead: `packing=True` with the padding-free strategies `'bfd'`/`'bfd_split'` "
        "(use `packing_strategy='wrapped'`: each packed row is then the privacy unit), `padding_free=True`, "
        "`activation_offloading=True`, `packing=True` with `privacy_unit='user'` (packed rows mix users), and TRL "
        "loss types other than `'nll'` and `'dft'`.\n\n"
        "    hf_dp's per-example loss is `dp_loss_type` (always `'causal_lm'` for SFT); TRL's `loss_type` keeps its "
        f"meaning.\n\n    Parameters:{_DP_PARAMETERS_DOC}"
    )

    dp_loss_type: str = field(
        default="causal_lm",
        metadata={"help": "hf_dp's per-example loss: SFT trains a causal LM ('causal_lm')."},
    )

    def __post_init__(self):
        super().__post_init__()
        _check_sft_fields(self)


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

    Unit of privacy: one row of the training set TRL prepares: one example, or with ``packing=True,
    packing_strategy="wrapped"`` one packed row of ``max_length`` tokens. With packing the guarantee is with respect
    to the packed rows, not the original documents: a document cut over several rows, or the addition or removal of
    one document (which re-cuts every later row), is not covered as one unit. The model card's unit line says so.
    With ``privacy_unit="user"`` the unit is every row of one user (the user column passes through TRL's preparation);
    packing is then refused, since a packed row mixes users. Padding-free packing (``packing_strategy="bfd"``, TRL's
    default for ``packing=True``) and ``padding_free=True`` are refused before training.

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
            _check_sft_fields,
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
        with _quiet_model_init_kwargs_warning(loaded_from is not None):
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

    # ------------------------------------------------------------------ loss
    def _model_inputs(self, model, inputs):
        """The batch without labels, and ``use_cache=False`` (as SFTTrainer: no cache while training)."""
        model_inputs = super()._model_inputs(model, inputs)
        model_inputs.setdefault("use_cache", False)
        return model_inputs

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]``: the next-token loss of each example over its own labelled tokens (``nll``), or TRL's DFT loss
        (``dft``: each token's NLL times its detached probability), reduced per example."""
        if self.args.loss_type != "dft" or self.compute_loss_func is not None:
            return super().compute_per_example_loss(outputs, inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        labels = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
        if "shift_labels" not in inputs:
            logits = logits[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
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
        """The DP section; with wrapped packing its unit line says the unit is a packed row."""
        section = super().dp_model_card_section(epsilon_plot=epsilon_plot)
        if self.args.packing:
            section = section.replace(_UNIT_ROW, _PACKED_UNIT_ROW)
        return section


def prepare_trl_init(
    trainer: str,
    config_class: type,
    check_fields: Callable,
    args,
    model,
    train_dataset,
    quantization_config,
    processing_class,
):
    """What a DP TRL trainer checks and loads before TRL's ``__init__``: the arguments as ``config_class`` (checked
    again: they may have changed after they were built), a training set of text (no vision datasets yet), the model
    loaded here when given as a name (as TRL would, so that hf_dp's checks see it), the MoE auxiliary loss refused.

    Returns:
        ``(args, model, processing_class, quantization_config, loaded_from)``; ``loaded_from`` is the model's name when
        it was loaded here (``quantization_config`` then went into the load), else ``None``.
    """
    from .checks import dp_arguments

    args = dp_arguments(args, config_class)
    check_fields(args)
    if train_dataset is None:
        raise ValueError(f"{trainer} needs `train_dataset` (its size N sets the sample rate and delta).")
    sample = next(iter(train_dataset))
    if isinstance(sample, dict) and ("image" in sample or "images" in sample):
        raise ValueError(
            f"{trainer} does not support vision-language datasets (`image`/`images` columns) yet: TRL prepares them "
            "on the fly in its vision collator, which hf_dp has not been checked against. Use a text dataset."
        )
    loaded_from = None
    if isinstance(model, str):
        loaded_from = model
        model, processing_class = _load_model(model, args, quantization_config, processing_class)
        quantization_config = None
    _check_router_aux_loss(model, args)
    return args, model, processing_class, quantization_config, loaded_from


def _load_model(model_id: str, args: DPSFTConfig, quantization_config, processing_class):
    """The model (and, when not given, the processor) SFTTrainer would load from ``model_id``."""
    from transformers import AutoProcessor, set_seed
    from trl.trainer.utils import create_model_from_path

    set_seed(args.seed)
    model_init_kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        if "quantization_config" in model_init_kwargs:
            raise ValueError(
                "You set `quantization_config` both as a trainer argument and in `args.model_init_kwargs`. Set it in "
                "one place only."
            )
        model_init_kwargs["quantization_config"] = quantization_config
    if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
        model_init_kwargs["device_map"] = None
    model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    model = create_model_from_path(model_id, **model_init_kwargs)
    if processing_class is None:
        processing_class = AutoProcessor.from_pretrained(
            model_id, revision=model_init_kwargs.get("revision"), trust_remote_code=args.trust_remote_code
        )
    return model, processing_class


def _check_router_aux_loss(model, args) -> None:
    """MoE load-balancing losses are batch statistics (they couple the examples of a micro-batch): refused."""
    config = getattr(model, "config", None)
    if config is None:
        return
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if hasattr(text_config, "output_router_logits") and coef:
        raise ValueError(
            f"The MoE load-balancing loss (`router_aux_loss_coef={coef}`) is a statistic of the whole micro-batch (the "
            "fraction of its tokens routed to each expert), so it couples examples and cannot be clipped per "
            "example. Set `router_aux_loss_coef=0.0` in DPSFTConfig."
        )


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def _quiet_model_init_kwargs_warning(active: bool, trainer_module=None):
    """TRL's trainers (``trainer_module``'s logger; SFT by default) warn that `model_init_kwargs` are ignored for a
    model object; the DP trainers did use them, loading the model themselves."""
    if not active:
        yield
        return
    if trainer_module is None:
        from trl.trainer import sft_trainer as trainer_module

    log = getattr(trainer_module, "logger", None)
    log = getattr(log, "logger", log)  # accelerate's MultiProcessAdapter around a logging.Logger
    if not isinstance(log, logging.Logger):
        yield
        return
    drop = _DropMessage("`model_init_kwargs` will be ignored")
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)
