"""Poisson sampling of logical batches, split into the micro-batches of gradient accumulation.

Every logical batch includes each example independently with probability ``q`` (the subsampling the accountants
assume); its size is ``Binomial(N, q)``, so it can be empty. It is then split into exactly
``num_micro_batches`` micro-batches whose sizes differ by at most one (some may be empty), so that the Trainer's
accumulation boundaries are the logical-batch boundaries.

Logical batch ``k`` of a run (``k = draw_offset + epoch * steps_per_epoch + j``) is drawn from a generator seeded by
``(seed, k)`` alone. Who knows the seed knows which examples every step used, which voids the privacy amplification by
subsampling the accountants rely on, so ``DPTrainer`` passes a secret seed drawn from the operating system at every
start and never writes it (DESIGN §4 rule 14); only a run with a fixed ``noise_seed`` (tests) uses a known seed, and
then resuming reproduces the uninterrupted run exactly. ``draw_offset`` makes a later ``train()`` call, or a resume
that does not skip the batches already used, continue with draws never used before: no path replays a draw while
counting it as fresh. ``secure=True`` draws the inclusion bits from SHAKE-256 keyed by the seed (a cryptographic
generator) instead of NumPy's PCG64. With several processes, every rank draws the same logical batch and keeps its own
share, so that the union over ranks is one Poisson draw.

Given example lengths, each logical batch is ordered longest first before it is shared and split, so that every
micro-batch holds examples of similar length and pads little. This changes only how a logical batch is cut into
micro-batches, never which examples it holds, so the privacy analysis is unchanged (clipping is per example and noise is
added once per logical batch).

:class:`~hf_dp.sampling.users.PoissonUserBatchSampler` (user-level DP) shares the schedule (:class:`_PoissonSchedule`)
and the inclusion stream (:func:`_uniforms`), drawn over users instead of rows.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

__all__ = ["PoissonBatchSampler"]


def _uniforms(seed: int, draw: int, n: int, secure: bool) -> np.ndarray:
    """``n`` uniforms in [0, 1) of logical batch ``draw``, keyed by ``(seed, draw)`` alone.

    ``secure``: SHAKE-256 of ``"{seed}:{draw}"`` (53 bits of each 64-bit word); otherwise NumPy's PCG64 seeded by
    ``[seed, draw]``. Shared by every Poisson sampler of the package, so that one draw means one key.
    """
    if secure:
        stream = hashlib.shake_256(f"{seed}:{draw}".encode()).digest(8 * n)
        return (np.frombuffer(stream, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.random.default_rng([seed, draw]).random(n)


class _PoissonSchedule(Sampler[list[int]]):
    """What every Poisson batch sampler shares: the arguments of the schedule, the epoch and the draws it uses.

    Logical batch ``j`` of epoch ``e`` is draw ``draw_offset + e * steps_per_epoch + j``; each yields exactly
    ``num_micro_batches`` micro-batches, so ``len`` is ``steps_per_epoch * num_micro_batches``.
    """

    def _init_schedule(
        self,
        sample_rate: float,
        num_micro_batches: int,
        steps_per_epoch: int | None,
        seed: int,
        draw_offset: int,
        secure: bool,
        num_replicas: int,
        rank: int,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"`sample_rate` must be in (0, 1], got {sample_rate}.")
        if num_micro_batches < 1:
            raise ValueError(f"`num_micro_batches` must be >= 1, got {num_micro_batches}.")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be in [0, {num_replicas}), got {rank}.")
        if draw_offset < 0:
            raise ValueError(f"`draw_offset` must be >= 0, got {draw_offset}.")
        self.sample_rate = sample_rate
        self.num_micro_batches = num_micro_batches
        self.steps_per_epoch = steps_per_epoch or max(1, math.floor(1 / sample_rate))
        self.seed = seed
        self.draw_offset = draw_offset
        self.secure = secure
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0

    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_micro_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> _PoissonSchedule:
        # accelerate's DataLoaderShard.set_epoch also reaches `batch_sampler.batch_sampler.sampler.set_epoch`.
        return self

    def _draws(self) -> range:
        """The draws (logical-batch keys) of the current epoch."""
        first = self.draw_offset + self.epoch * self.steps_per_epoch
        return range(first, first + self.steps_per_epoch)


class PoissonBatchSampler(_PoissonSchedule):
    """Batch sampler yielding ``steps_per_epoch * num_micro_batches`` lists of indices per epoch.

    Args:
        num_samples (`int`): dataset size ``N``.
        sample_rate (`float`): ``q`` in (0, 1].
        num_micro_batches (`int`): micro-batches per logical batch (``gradient_accumulation_steps``).
        steps_per_epoch (`int`, *optional*): logical batches per epoch; defaults to ``max(1, floor(1 / q))``.
        seed (`int`, *optional*, defaults to 0): base seed; logical batch ``k`` uses ``(seed, k)``. Keep it secret.
        draw_offset (`int`, *optional*, defaults to 0): index of the first logical batch of epoch 0.
        secure (`bool`, *optional*, defaults to `False`): draw from SHAKE-256 keyed by ``seed`` (cryptographic).
        num_replicas (`int`, *optional*, defaults to 1): number of processes sharing each logical batch.
        rank (`int`, *optional*, defaults to 0): this process's share.
        lengths (`Sequence[int]`, *optional*): length of every example; when given, micro-batches group examples of
            similar length (longest first).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        num_micro_batches: int,
        steps_per_epoch: int | None = None,
        *,
        seed: int = 0,
        draw_offset: int = 0,
        secure: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        lengths: Sequence[int] | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"`num_samples` must be > 0, got {num_samples}.")
        self._init_schedule(
            sample_rate, num_micro_batches, steps_per_epoch, seed, draw_offset, secure, num_replicas, rank
        )
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"`lengths` has {len(lengths)} entries for {num_samples} examples.")
        self.num_samples = num_samples
        self.lengths = None if lengths is None else np.asarray(lengths)

    def __repr__(self) -> str:  # never show the seed
        return (
            f"PoissonBatchSampler(num_samples={self.num_samples}, sample_rate={self.sample_rate}, "
            f"num_micro_batches={self.num_micro_batches}, steps_per_epoch={self.steps_per_epoch})"
        )

    def _uniforms(self, draw: int) -> np.ndarray:
        return _uniforms(self.seed, draw, self.num_samples, self.secure)

    def logical_batches(self) -> Iterator[np.ndarray]:
        """The logical batches of the current epoch (indices over all ranks)."""
        for draw in self._draws():
            yield np.flatnonzero(self._uniforms(draw) < self.sample_rate)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.logical_batches():
            if self.lengths is not None:
                batch = batch[np.argsort(-self.lengths[batch], kind="stable")]
            share = batch[self.rank :: self.num_replicas]
            for micro in np.array_split(share, self.num_micro_batches):
                yield micro.tolist()
