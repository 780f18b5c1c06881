"""Cyclic Poisson sampling: the sampling of banded correlated noise (``noise_mechanism="banded-toeplitz"``).

Every unit of the training set (a row, or a user with user-level DP) is put once in one of ``b`` fixed parts, chosen
uniformly and independently of every other unit from the run's secret sampling seed (independent parts, not an equal
split of a shuffled set: with an equal split, adding or removing one unit would move others between parts, and the
accountants' neighbouring relation is add/remove; jax_privacy's ``PartitionType.INDEPENDENT``). Logical batch ``t``
(its draw index, which is the noisy step it is used for) samples only part ``t mod b``: each unit of that part is in
the batch independently with probability ``q_part = b L / N`` (so ``L`` units are expected per step, as with Poisson
sampling at ``q = L / N``); units of the other parts are not. A unit can therefore be in two batches only ``b`` or
more steps apart, which is what the amplified analysis of banded matrix factorization needs (Choquette-Choo et al.
2023): its epsilon after ``T`` steps is DP-SGD's for ``ceil(T / b)`` steps at ``(sigma, q_part)``.

The inclusion uniforms are those of :class:`~hf_dp.sampling.poisson.PoissonBatchSampler` (the key ``(seed, draw)``),
so with ``b = 1`` (one part, the whole set) the batches are exactly its batches for the same seed. The parts are keyed
by the same secret (SHAKE-256 of ``"{seed}:parts"``, with or without ``secure``: a key no draw uses), and are never
shown or written. A unit's part depends on its index and the seed only, so a resume with the same seed keeps every
unit in its part. The micro-batches, the ranks' shares, the
length grouping and the users' row subsets are those of the Poisson samplers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from .poisson import PoissonBatchSampler
from .users import PoissonUserBatchSampler

__all__ = ["CyclicPoissonBatchSampler", "CyclicPoissonUserBatchSampler", "cyclic_parts"]


def cyclic_parts(seed: int, num_units: int, bands: int) -> np.ndarray:
    """The part (``0 .. bands-1``) of every unit, each uniform and independent of the others, from the secret seed
    (all zeros for ``bands == 1``): SHAKE-256 of ``"{seed}:parts"``, a key no inclusion draw uses (theirs are
    ``"{seed}:{draw}"`` or PCG64 seeded by ``[seed, draw]``: a ``SeedSequence([seed], spawn_key=(1,))`` would be draw
    1's own stream for a 128-bit seed, NumPy padding the seed to 4 words before the spawn key)."""
    if bands < 1:
        raise ValueError(f"`bands` must be >= 1, got {bands}.")
    if bands == 1:
        return np.zeros(num_units, dtype=np.int64)
    stream = hashlib.shake_256(f"{seed}:parts".encode()).digest(8 * num_units)
    return (np.frombuffer(stream, dtype=np.uint64) % np.uint64(bands)).astype(np.int64)  # bias < b / 2**64


def _check_rate(sample_rate: float, bands: int) -> None:
    if bands < 1:
        raise ValueError(f"`bands` must be >= 1, got {bands}.")
    if not 0 < sample_rate <= 1:
        raise ValueError(
            f"The sample rate of a part, q_part = b L / N = {sample_rate:g}, must be in (0, 1]: each of the b = {bands}"
            " parts must hold at least the expected batch. Use fewer bands (`noise_bands`) or a smaller batch."
        )


class CyclicPoissonBatchSampler(PoissonBatchSampler):
    """:class:`~hf_dp.sampling.poisson.PoissonBatchSampler` over part ``draw mod bands`` of the rows.

    Args:
        num_samples (`int`): ``N``; ``sample_rate`` (`float`): ``q_part``, the inclusion probability of a row of the
            sampled part; ``bands`` (`int`): ``b``, the number of parts. The other arguments are
            :class:`PoissonBatchSampler`'s (``steps_per_epoch`` should be ``N / L``, the steps of one pass).
    """

    def __init__(self, num_samples: int, sample_rate: float, num_micro_batches: int, *args, bands: int, **kwargs):
        _check_rate(sample_rate, bands)
        super().__init__(num_samples, sample_rate, num_micro_batches, *args, **kwargs)
        self.bands = int(bands)
        self.parts = cyclic_parts(self.seed, num_samples, self.bands)

    def __repr__(self) -> str:  # never show the seed or the parts
        return super().__repr__()[:-1].replace("PoissonBatchSampler", "CyclicPoissonBatchSampler", 1) + (
            f", bands={self.bands})"
        )

    def logical_batches(self) -> Iterator[np.ndarray]:
        """The logical batches of the current epoch: rows of part ``draw mod b`` whose uniform is below ``q_part``."""
        for draw in self._draws():
            included = self._uniforms(draw) < self.sample_rate
            if self.bands > 1:
                included &= self.parts == draw % self.bands
            yield np.flatnonzero(included)


class CyclicPoissonUserBatchSampler(PoissonUserBatchSampler):
    """:class:`~hf_dp.sampling.users.PoissonUserBatchSampler` over part ``draw mod bands`` of the users (the users,
    not the rows, are split into parts; a sampled user contributes at most ``max_examples_per_user`` rows, as there).
    """

    def __init__(self, user_ids, sample_rate: float, num_micro_batches: int, *args, bands: int, **kwargs):
        _check_rate(sample_rate, bands)
        super().__init__(user_ids, sample_rate, num_micro_batches, *args, **kwargs)
        self.bands = int(bands)
        self.parts = cyclic_parts(self.seed, self.num_users, self.bands)

    def __repr__(self) -> str:  # never show the seed or the parts
        return super().__repr__()[:-1].replace("PoissonUserBatchSampler", "CyclicPoissonUserBatchSampler", 1) + (
            f", bands={self.bands})"
        )

    def logical_batches(self) -> Iterator[np.ndarray]:
        """The sampled user codes of each draw: users of part ``draw mod b`` whose uniform is below ``q_part``."""
        for draw in self._draws():
            included = self._inclusion_uniforms(draw) < self.sample_rate
            if self.bands > 1:
                included &= self.parts == draw % self.bands
            yield np.flatnonzero(included)
