"""hf_dp: differentially private fine-tuning of Hugging Face models with book-keeping clipping.

The package follows the data path (``docs/architecture.md``): ``sampling/`` (Poisson logical batches) ->
``losses.py`` (one loss per example) -> ``engine/`` + ``layers/`` (book-kept clipping) -> ``step/`` (noise, once per
logical step) -> ``accounting/`` + ``ledger/`` (the privacy spent) -> ``release/`` (what leaves the process), with
``plan/`` (the frozen settings of a run) and ``trainers/`` (thin ``Trainer`` subclasses over all of it).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._moved import install_moved_module_aliases
from .arguments import DPArgumentsMixin, DPSeq2SeqTrainingArguments, DPTrainingArguments
from .engine import CLIPPING_MODES, BookKeepingClipper, SelfCheckError
from .layers import LayerRule, UnsupportedModuleError, register_rule
from .ledger.callback import DPCallback
from .plan.batchnorm import replace_batchnorm
from .sampling.poisson import PoissonBatchSampler
from .trainers.mixin import DPTrainerMixin
from .trainers.seq2seq import DPSeq2SeqTrainer
from .trainers.trainer import DPTrainer
from .version import __version__ as __version__

#: Public names imported on first use, from the module that defines them (trl's ``_import_structure``): the TRL
#: trainers, so that ``import hf_dp`` never imports TRL.
_LAZY_NAMES = {
    "DPCPOConfig": "hf_dp.trainers.cpo_config",
    "DPCPOTrainer": "hf_dp.trainers.cpo_trainer",
    "DPDPOConfig": "hf_dp.trainers.dpo_config",
    "DPDPOTrainer": "hf_dp.trainers.dpo_trainer",
    "DPORPOConfig": "hf_dp.trainers.orpo_config",
    "DPORPOTrainer": "hf_dp.trainers.orpo_trainer",
    "DPRewardConfig": "hf_dp.trainers.reward_config",
    "DPRewardTrainer": "hf_dp.trainers.reward_trainer",
    "DPSFTConfig": "hf_dp.trainers.sft_config",
    "DPSFTTrainer": "hf_dp.trainers.sft_trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_NAMES])


install_moved_module_aliases()

__all__ = [
    "CLIPPING_MODES",
    "BookKeepingClipper",
    "DPArgumentsMixin",
    "DPCallback",
    "DPSeq2SeqTrainer",
    "DPSeq2SeqTrainingArguments",
    "DPTrainer",
    "DPTrainerMixin",
    "DPTrainingArguments",
    "LayerRule",
    "PoissonBatchSampler",
    "SelfCheckError",
    "UnsupportedModuleError",
    "register_rule",
    "replace_batchnorm",
]
