"""The DP trainers: thin ``Trainer`` subclasses over :class:`~hf_dp.trainers.mixin.DPTrainerMixin`.

One file per trainer (:mod:`.trainer`, :mod:`.seq2seq`), and a config + trainer file pair per TRL trainer
(:mod:`.sft_config` + :mod:`.sft_trainer`, :mod:`.dpo_config` + :mod:`.dpo_trainer`, :mod:`.reward_config` +
:mod:`.reward_trainer`, :mod:`.orpo_config` + :mod:`.orpo_trainer`, :mod:`.cpo_config` + :mod:`.cpo_trainer`) over
what they share (:mod:`.trl_common`; ORPO and CPO also :mod:`.pair_policy`). The mixin's Trainer hooks are split by
stage: :mod:`.sampling_hooks`, :mod:`.mixin` (per-example loss and the DP step), :mod:`.record_hooks`,
:mod:`.release_hooks`. The TRL modules import TRL and are loaded on
first use (``hf_dp.DPSFTTrainer``); this package's ``__init__`` does not import them.
"""

from .mixin import DPTrainerMixin
from .seq2seq import DPSeq2SeqTrainer
from .trainer import DPTrainer

__all__ = ["DPSeq2SeqTrainer", "DPTrainer", "DPTrainerMixin"]
