"""The TRL trainers at their documented path: ``from hf_dp.trl import DPSFTTrainer, DPSFTConfig`` (and the DPO and
reward-modelling pairs).

They live in :mod:`hf_dp.trainers` (a config and a trainer file per TRL trainer); this module imports TRL, ``import
hf_dp`` does not (``hf_dp.DPSFTTrainer`` imports it on first use).
"""

from .trainers.dpo_config import DPDPOConfig
from .trainers.dpo_trainer import DPDPOTrainer
from .trainers.reward_config import DPRewardConfig
from .trainers.reward_trainer import DPRewardTrainer
from .trainers.sft_config import DPSFTConfig
from .trainers.sft_trainer import DPSFTTrainer

__all__ = ["DPDPOConfig", "DPDPOTrainer", "DPRewardConfig", "DPRewardTrainer", "DPSFTConfig", "DPSFTTrainer"]
