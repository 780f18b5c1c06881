"""The TRL trainers at their documented path: ``from hf_dp.trl import DPSFTTrainer, DPSFTConfig`` (and the DPO,
reward-modelling, ORPO and CPO pairs).

They live in :mod:`hf_dp.trainers` (a config and a trainer file per TRL trainer); this module imports TRL, ``import
hf_dp`` does not (``hf_dp.DPSFTTrainer`` imports it on first use). ORPO and CPO are TRL's experimental trainers
(``trl.experimental.orpo``, ``trl.experimental.cpo``: APIs TRL may change without notice); their names are imported
on first use here too, so that importing this module does not load TRL's experimental trainers.
"""

import importlib
from typing import Any

from .trainers.dpo_config import DPDPOConfig
from .trainers.dpo_trainer import DPDPOTrainer
from .trainers.reward_config import DPRewardConfig
from .trainers.reward_trainer import DPRewardTrainer
from .trainers.sft_config import DPSFTConfig
from .trainers.sft_trainer import DPSFTTrainer

#: The trainers over ``trl.experimental``, imported on first use.
_EXPERIMENTAL = {
    "DPCPOConfig": "hf_dp.trainers.cpo_config",
    "DPCPOTrainer": "hf_dp.trainers.cpo_trainer",
    "DPORPOConfig": "hf_dp.trainers.orpo_config",
    "DPORPOTrainer": "hf_dp.trainers.orpo_trainer",
}


def __getattr__(name: str) -> Any:
    if name in _EXPERIMENTAL:
        return getattr(importlib.import_module(_EXPERIMENTAL[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPERIMENTAL])


__all__ = [  # the experimental names are served by __getattr__
    "DPDPOConfig",
    "DPDPOTrainer",
    "DPRewardConfig",
    "DPRewardTrainer",
    "DPSFTConfig",
    "DPSFTTrainer",
    *_EXPERIMENTAL,
]
