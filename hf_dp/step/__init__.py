"""Clip and noise: the DP step, built from plain numbers (sigma, q, L, C), testable with an ``nn.Module`` alone.

* :mod:`.dp_step`: :class:`DPStep`, per micro-batch the per-example loss to the clipper and the clipped sum into the
  gradients; per logical batch the noise, the all-reduce, the privacy record and the next C;
* :mod:`.noise`: :class:`NoiseSource`, the Gaussian noise from a secret that never leaves the process;
* :mod:`.bandmf`: BandMF, noise correlated across steps by a banded Toeplitz strategy (import from there);
* :mod:`.backends`: where the step runs (one process or DDP, FSDP2), over :mod:`.distributed` and :mod:`.fsdp`;
* :mod:`.loss_scale`: fp16 loss scaling driven by a noised overflow count;
* :mod:`.adaptive_clipping`, :mod:`.adaptive_state`: quantile-adaptive C (the math, and the step's running count).
"""

from .adaptive_clipping import QuantileClipping
from .adaptive_state import AdaptiveClippingState
from .backends import DataParallel, FullySharded
from .dp_step import DPStep, DPStepSettings, PrivacyRecord
from .loss_scale import NoisedLossScaling, NoisedOverflowScalePolicy
from .noise import NoiseSource

__all__ = [
    "AdaptiveClippingState",
    "DPStep",
    "DPStepSettings",
    "DataParallel",
    "FullySharded",
    "NoiseSource",
    "NoisedLossScaling",
    "NoisedOverflowScalePolicy",
    "PrivacyRecord",
    "QuantileClipping",
]
