"""What the DP trainers for TRL share: TRL itself (imported here, at the version hf_dp needs; the TRL classes the DP
configs and trainers extend come from here), the checks and the model loading a TRL trainer does before TRL's
``__init__``, and the card's unit rows. Every TRL trainer module (:mod:`.sft_trainer`, :mod:`.dpo_trainer`,
:mod:`.reward_trainer`, :mod:`.orpo_trainer`, :mod:`.cpo_trainer`) imports this module, never another trainer's.

This module imports TRL; ``import hf_dp`` does not (``hf_dp.DPSFTTrainer`` imports it on first use). Install it with
``pip install 'hf_dp[trl]'``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

try:
    import trl as _trl
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
except ImportError as error:  # pragma: no cover - exercised in an environment without TRL
    raise ImportError(
        "hf_dp's TRL trainers (DPSFTTrainer, DPDPOTrainer, DPRewardTrainer, DPORPOTrainer, DPCPOTrainer and their "
        "configs) need TRL: install it with `pip install 'hf_dp[trl]'` (trl>=1.0)."
    ) from error

from packaging.version import Version

from ..plan.checks import dp_arguments

if Version(_trl.__version__) < Version("1.0"):  # pragma: no cover
    raise ImportError(f"hf_dp's TRL trainers need trl>=1.0, found {_trl.__version__}: `pip install 'hf_dp[trl]'`.")

__all__ = [
    "PAIR_UNIT_ROW",
    "UNIT_ROW",
    "DPOConfig",
    "DPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "pair_card_section",
    "prepare_trl_init",
    "quiet_model_init_kwargs_warning",
]

#: The card's unit row for one training example (the TRL trainers replace it with their own unit).
UNIT_ROW = "| Unit of privacy | one training example (one row of the training set) |"
#: The unit row of the preference trainers (DPO, reward modelling, ORPO, CPO): the pair is the example.
PAIR_UNIT_ROW = (
    "| Unit of privacy | one preference pair (a prompt with its chosen and rejected completions: one row of the "
    "training set) |"
)


def pair_card_section(section: str) -> str:
    """The DP card section of a preference trainer: its unit line says one preference pair (a user-level section,
    whose unit line names the user column, is left as it is)."""
    return section.replace(UNIT_ROW, PAIR_UNIT_ROW)


def prepare_trl_init(
    trainer: str,
    config_class: type,
    check_fields: Callable,
    args,
    model,
    train_dataset,
    quantization_config,
    processing_class,
    *,
    architecture=None,
    init_overrides: dict | None = None,
    router_aux_loss: bool = True,
):
    """What a DP TRL trainer checks and loads before TRL's ``__init__``: the arguments as ``config_class`` (checked
    again: they may have changed after they were built), a training set of text (no vision datasets yet), the model
    loaded here when given as a name (as TRL would, so that hf_dp's checks see it: with ``architecture``, an
    ``AutoModel*`` class, else the class its config names, and ``init_overrides`` over ``model_init_kwargs``), the MoE
    auxiliary loss refused (where the TRL trainer would add it: ``router_aux_loss``).

    Returns:
        ``(args, model, processing_class, quantization_config, loaded_from)``; ``loaded_from`` is the model's name when
        it was loaded here (``quantization_config`` then went into the load), else ``None``.
    """
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
        model, processing_class = _load_model(
            model, args, quantization_config, processing_class, architecture, init_overrides or {}
        )
        quantization_config = None
    if router_aux_loss:
        _check_router_aux_loss(model, args)
    return args, model, processing_class, quantization_config, loaded_from


def _load_model(model_id: str, args, quantization_config, processing_class, architecture, overrides: dict):
    """The model (and, when not given, the processor) TRL's trainers would load from ``model_id``."""
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
    model_init_kwargs.update(overrides)
    model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    model = create_model_from_path(model_id, architecture, **model_init_kwargs)
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
    if hasattr(args, "router_aux_loss_coef"):  # SFTConfig, DPOConfig: TRL turns the router logits on when it is set
        coef = args.router_aux_loss_coef
        coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
        active = hasattr(text_config, "output_router_logits") and coef
        where = f"`router_aux_loss_coef=0.0` in {type(args).__name__}"
    else:  # ORPO, CPO: TRL adds the model's auxiliary loss when its config turns the router logits on
        coef = getattr(text_config, "router_aux_loss_coef", 0.0)
        active = getattr(text_config, "output_router_logits", False) and coef
        where = "`output_router_logits=False` (or `router_aux_loss_coef=0.0`) in the model's config"
    if active:
        raise ValueError(
            f"The MoE load-balancing loss (`router_aux_loss_coef={coef}`) is a statistic of the whole micro-batch (the "
            "fraction of its tokens routed to each expert), so it couples examples and cannot be clipped per "
            f"example. Set {where}."
        )


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_model_init_kwargs_warning(active: bool, trainer_module=None):
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
