"""Cyclic Poisson sampling: b = 1 is Poisson sampling bit for bit; b > 1 samples part t mod b only, every part of
a secret-seeded split, at rate q_part; users are split into parts the same way."""

import numpy as np
import pytest

from hf_dp.sampling import (
    CyclicPoissonBatchSampler,
    CyclicPoissonUserBatchSampler,
    PoissonBatchSampler,
    PoissonUserBatchSampler,
)
from hf_dp.sampling.cyclic import cyclic_parts
from hf_dp.sampling.poisson import _uniforms


@pytest.mark.parametrize("secure", [False, True])
def test_one_band_is_poisson_sampling_bit_for_bit(secure):
    kwargs = dict(steps_per_epoch=7, seed=1234, draw_offset=3, secure=secure, num_replicas=2, rank=1)
    plain = PoissonBatchSampler(200, 0.05, 3, **kwargs)
    cyclic = CyclicPoissonBatchSampler(200, 0.05, 3, bands=1, **kwargs)
    for epoch in (0, 2):
        plain.set_epoch(epoch)
        cyclic.set_epoch(epoch)
        assert list(cyclic) == list(plain)


def test_one_band_users_is_user_poisson_sampling_bit_for_bit():
    codes = np.random.default_rng(0).integers(0, 40, size=150)
    kwargs = dict(steps_per_epoch=6, max_examples_per_user=2, seed=99, num_replicas=1, rank=0)
    plain = PoissonUserBatchSampler(codes, 0.1, 2, **kwargs)
    cyclic = CyclicPoissonUserBatchSampler(codes, 0.1, 2, bands=1, **kwargs)
    assert list(cyclic) == list(plain)


def test_parts_are_independent_uniform_and_secret():
    parts = cyclic_parts(seed=5, num_units=4000, bands=4)
    counts = np.bincount(parts, minlength=4)
    assert counts.sum() == 4000 and np.all(np.abs(counts - 1000) < 4 * np.sqrt(4000 * 0.25 * 0.75))
    assert not np.array_equal(parts, cyclic_parts(seed=6, num_units=4000, bands=4))  # depends on the seed
    assert np.array_equal(parts, cyclic_parts(seed=5, num_units=4000, bands=4))
    # a unit's part depends on its index alone: adding units moves no one (add/remove neighbours)
    assert np.array_equal(cyclic_parts(seed=5, num_units=4001, bands=4)[:4000], parts)


@pytest.mark.parametrize("bands", [2, 4, 8])
def test_parts_are_independent_of_every_draws_inclusion_uniforms(bands):
    """The parts and the inclusion coins must be independent (the amplified analysis assumes it): with a 128-bit
    seed (what DPTrainer draws), a part must not be a function of some draw's uniforms, at any alignment of the two
    streams (a PCG64 stream keyed ``SeedSequence([seed], spawn_key=(1,))`` is draw 1's: ``parts[2k + 1]`` was
    ``floor(b * u_1[k])`` for every unit)."""
    seed, n = 0x9E3779B97F4A7C15F39CC0605CEDC834, 4000  # a fixed 128-bit seed
    parts = cyclic_parts(seed, n, bands)
    for secure in (False, True):
        for draw in range(4):
            cells = np.floor(bands * _uniforms(seed, draw, 2 * n, secure)).astype(np.int64)
            for aligned, codes in ((parts, cells[:n]), (parts[1::2], cells[: n // 2]), (parts[::2], cells[: n // 2])):
                agreement = float(np.mean(aligned == codes))
                assert agreement < 1 / bands + 0.06, (secure, draw, agreement)


def test_step_t_samples_only_part_t_mod_b_at_the_part_rate():
    n, bands, rate, steps = 400, 4, 0.5, 400
    sampler = CyclicPoissonBatchSampler(n, rate, 1, steps_per_epoch=steps, bands=bands, seed=11)
    parts = cyclic_parts(11, n, bands)
    counts = np.zeros(n)
    for t, batch in enumerate(sampler.logical_batches()):
        assert set(parts[batch].tolist()) <= {t % bands}
        counts[batch] += 1
    # every row is sampled in about rate * steps / bands of the steps (its part's), never elsewhere
    expected = rate * steps / bands
    assert abs(counts.mean() - expected) < 0.05 * expected
    assert counts.min() > 0


def test_a_unit_is_sampled_at_most_once_in_b_consecutive_steps():
    bands = 3
    sampler = CyclicPoissonBatchSampler(60, 0.9, 2, steps_per_epoch=30, bands=bands, seed=2)
    last = {}
    for t, batch in enumerate(sampler.logical_batches()):
        for i in batch.tolist():
            assert t - last.get(i, -bands) >= bands
            last[i] = t


def test_users_are_split_into_parts():
    codes = np.repeat(np.arange(30), 3)
    sampler = CyclicPoissonUserBatchSampler(codes, 0.8, 1, steps_per_epoch=12, bands=3, max_examples_per_user=3, seed=4)
    parts = cyclic_parts(4, 30, 3)
    for t, rows in enumerate(sampler):
        users = set(codes[rows].tolist())
        assert {int(parts[u]) for u in users} <= {t % 3}


def test_a_part_rate_above_one_is_refused():
    with pytest.raises(ValueError, match="fewer bands"):
        CyclicPoissonBatchSampler(100, 1.5, 1, bands=3)


def test_repr_shows_no_seed():
    sampler = CyclicPoissonBatchSampler(100, 0.3, 1, bands=3, seed=987654321)
    assert "987654321" not in repr(sampler) and "bands=3" in repr(sampler)
