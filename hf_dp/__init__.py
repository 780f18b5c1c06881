"""hf_dp: differentially private fine-tuning of Hugging Face models with book-keeping clipping."""

__version__ = "0.1.0"

from .arguments import DPSeq2SeqTrainingArguments, DPTrainingArguments  # noqa: E402
from .callback import DPCallback  # noqa: E402
from .engine import CLIPPING_MODES, BookKeepingClipper, SelfCheckError  # noqa: E402
from .layers import LayerRule, UnsupportedModuleError, register_rule  # noqa: E402
from .sampler import PoissonBatchSampler  # noqa: E402
from .seq2seq import DPSeq2SeqTrainer  # noqa: E402
from .trainer import DPTrainer  # noqa: E402

#: Names served by :mod:`hf_dp.trl` (imported on first use, so that ``import hf_dp`` never imports TRL).
_TRL_NAMES = ("DPDPOConfig", "DPDPOTrainer", "DPSFTConfig", "DPSFTTrainer")


def __getattr__(name: str):
    if name in _TRL_NAMES:
        from . import trl

        return getattr(trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CLIPPING_MODES",
    "BookKeepingClipper",
    "DPCallback",
    "DPSeq2SeqTrainer",
    "DPSeq2SeqTrainingArguments",
    "DPTrainer",
    "DPTrainingArguments",
    "LayerRule",
    "PoissonBatchSampler",
    "SelfCheckError",
    "UnsupportedModuleError",
    "register_rule",
]
