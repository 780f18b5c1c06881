"""hf_dp: differentially private fine-tuning of Hugging Face models with book-keeping clipping."""

__version__ = "0.1.0"

from .arguments import DPSeq2SeqTrainingArguments, DPTrainingArguments  # noqa: E402
from .callback import DPCallback  # noqa: E402
from .engine import CLIPPING_MODES, BookKeepingClipper, SelfCheckError  # noqa: E402
from .layers import LayerRule, UnsupportedModuleError, register_rule  # noqa: E402
from .sampler import PoissonBatchSampler  # noqa: E402
from .seq2seq import DPSeq2SeqTrainer  # noqa: E402
from .trainer import DPTrainer  # noqa: E402

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
