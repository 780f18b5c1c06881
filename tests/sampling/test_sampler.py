import numpy as np
import pytest

from hf_dp import PoissonBatchSampler
from hf_dp.sampling.collators import EmptyBatchSafeCollator, is_empty_batch


def logical_batches(sampler):
    micro = list(sampler)
    k = sampler.num_micro_batches
    return [sum(micro[i : i + k], []) for i in range(0, len(micro), k)], micro


class TestPoissonBatchSampler:
    def test_sizes_are_binomial(self):
        n, q = 200, 0.1
        sampler = PoissonBatchSampler(n, q, num_micro_batches=3, steps_per_epoch=4000, seed=1)
        batches, _ = logical_batches(sampler)
        sizes = np.array([len(b) for b in batches])
        mean, var = n * q, n * q * (1 - q)
        assert abs(sizes.mean() - mean) < 4 * np.sqrt(var / len(sizes))
        assert sizes.var() == pytest.approx(var, rel=0.1)

    def test_examples_are_included_independently(self):
        n, q = 50, 0.3
        sampler = PoissonBatchSampler(n, q, num_micro_batches=1, steps_per_epoch=6000, seed=2)
        batches, _ = logical_batches(sampler)
        incidence = np.zeros((len(batches), n))
        for t, b in enumerate(batches):
            assert len(set(b)) == len(b)  # no duplicates
            incidence[t, b] = 1
        freq = incidence.mean(0)
        assert np.all(np.abs(freq - q) < 5 * np.sqrt(q * (1 - q) / len(batches)))
        corr = np.corrcoef(incidence.T)[np.triu_indices(n, 1)]
        assert np.abs(corr).max() < 0.08

    def test_micro_batches_split_each_logical_batch(self):
        sampler = PoissonBatchSampler(30, 0.5, num_micro_batches=4, steps_per_epoch=20, seed=0)
        assert len(sampler) == 80
        batches, micro = logical_batches(sampler)
        assert len(micro) == 80
        for t in range(20):
            parts = micro[4 * t : 4 * t + 4]
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1
            assert sorted(sum(parts, [])) == sorted(batches[t])

    def test_seeded_by_epoch(self):
        a = PoissonBatchSampler(30, 0.3, 2, steps_per_epoch=5, seed=7)
        b = PoissonBatchSampler(30, 0.3, 2, steps_per_epoch=5, seed=7)
        assert list(a) == list(b)
        first = list(a)
        a.set_epoch(1)
        assert list(a) != first
        b.set_epoch(1)
        assert list(a) == list(b)

    def test_ranks_share_one_draw(self):
        full = PoissonBatchSampler(40, 0.4, 2, steps_per_epoch=6, seed=3)
        ranks = [PoissonBatchSampler(40, 0.4, 2, steps_per_epoch=6, seed=3, num_replicas=2, rank=r) for r in range(2)]
        full_batches, _ = logical_batches(full)
        rank_batches = [logical_batches(s)[0] for s in ranks]
        for t, batch in enumerate(full_batches):
            union = rank_batches[0][t] + rank_batches[1][t]
            assert sorted(union) == sorted(batch)
            assert not set(rank_batches[0][t]) & set(rank_batches[1][t])

    @pytest.mark.parametrize("num_replicas", [1, 2])
    def test_grouping_by_length_keeps_the_draw_and_orders_micro_batches(self, num_replicas):
        n, k = 60, 3
        lengths = np.random.default_rng(5).integers(1, 50, n)
        full_draw = list(PoissonBatchSampler(n, 0.5, 1, steps_per_epoch=8, seed=4).logical_batches())
        for rank in range(num_replicas):
            kwargs = dict(steps_per_epoch=8, seed=4, num_replicas=num_replicas, rank=rank)
            grouped = PoissonBatchSampler(n, 0.5, k, lengths=lengths, **kwargs)
            grouped_batches, micro = logical_batches(grouped)
            for t, batch in enumerate(grouped_batches):
                assert set(batch) <= set(full_draw[t].tolist())
                if num_replicas == 1:
                    assert sorted(batch) == full_draw[t].tolist()
                parts = micro[k * t : k * t + k]
                sizes = [len(p) for p in parts]
                assert max(sizes) - min(sizes) <= 1
                for longer, shorter in zip(parts, parts[1:], strict=False):
                    if longer and shorter:
                        assert lengths[longer].min() >= lengths[shorter].max()
        if num_replicas > 1:  # the shares of all ranks still make up exactly one draw
            shares = [
                logical_batches(
                    PoissonBatchSampler(n, 0.5, k, lengths=lengths, steps_per_epoch=8, seed=4, num_replicas=2, rank=r)
                )[0]
                for r in range(2)
            ]
            for t, draw in enumerate(full_draw):
                assert sorted(shares[0][t] + shares[1][t]) == draw.tolist()

    def test_default_steps_per_epoch(self):
        assert PoissonBatchSampler(100, 0.03, 1).steps_per_epoch == 33

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"num_samples": 0},
            {"sample_rate": 0.0},
            {"sample_rate": 1.5},
            {"num_micro_batches": 0},
            {"lengths": [3, 4]},
        ],
    )
    def test_bad_arguments(self, kwargs):
        args = {"num_samples": 10, "sample_rate": 0.5, "num_micro_batches": 1, **kwargs}
        with pytest.raises(ValueError):
            PoissonBatchSampler(**args)


def test_empty_batch_collator():
    collator = EmptyBatchSafeCollator(lambda feats: {"x": feats})
    assert is_empty_batch(collator([]))
    assert collator([1]) == {"x": [1]} and not is_empty_batch(collator([1]))
