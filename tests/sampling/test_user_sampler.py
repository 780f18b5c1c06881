import itertools
import math

import numpy as np
import pytest
from scipy import stats
from torch.utils.data import DataLoader

from hf_dp.sampling.poisson import PoissonBatchSampler
from hf_dp.sampling.users import PoissonUserBatchSampler, encode_users


def per_draw(sampler):
    """The micro-batches of every draw of the current epoch: a list (per draw) of ``num_micro_batches`` lists."""
    micro = list(sampler)
    m = sampler.num_micro_batches
    assert len(micro) == len(sampler) == sampler.steps_per_epoch * m
    return [micro[i : i + m] for i in range(0, len(micro), m)]


def scattered_users(row_counts, seed=0):
    """User codes of a training set whose users have ``row_counts`` rows, in a shuffled (non-contiguous) row order."""
    codes = np.repeat(np.arange(len(row_counts)), row_counts)
    return np.random.default_rng(seed).permutation(codes)


def runs(sequence):
    return [key for key, _ in itertools.groupby(sequence)]


def check_layout(sampler, user_ids, drawn_users, parts):
    """Checks one logical batch (``parts``: its micro-batches on one rank) against the users it should hold."""
    k = sampler.max_examples_per_user
    counts = np.bincount(user_ids, minlength=sampler.num_users)
    rows = [r for part in parts for r in part]
    assert len(set(rows)) == len(rows)  # no row twice
    users = user_ids[rows] if rows else np.array([], dtype=int)
    # every user of the batch comes as one contiguous run, inside one micro-batch
    order = runs(users.tolist())
    assert len(order) == len(set(order))
    for part in parts:
        assert len(runs(user_ids[part].tolist())) == len(set(user_ids[part].tolist()))
    owners = {}
    for index, part in enumerate(parts):
        for u in set(user_ids[part].tolist()):
            assert u not in owners
            owners[u] = index
    # the sampled users with rows, and for each exactly min(k, n_u) of its own rows
    expected = {int(u) for u in drawn_users if counts[u] > 0}
    assert set(order) == expected
    got = np.bincount(users, minlength=sampler.num_users)
    for u in expected:
        assert got[u] == min(k, counts[u]) <= k
    # micro-batches balance the rows: each is within k rows of an equal share
    sizes = np.array([len(p) for p in parts])
    assert np.all(np.abs(sizes - sizes.sum() / len(parts)) <= k)
    return rows


class TestInclusion:
    def test_users_are_included_independently_with_probability_q(self):
        num_users, q, draws = 50, 0.1, 4000
        user_ids = scattered_users(np.random.default_rng(1).integers(1, 4, num_users))
        sampler = PoissonUserBatchSampler(user_ids, q, 1, steps_per_epoch=draws, max_examples_per_user=2, seed=11)
        incidence = np.zeros((draws, num_users))
        for t, users in enumerate(sampler.logical_batches()):
            assert len(set(users.tolist())) == len(users)
            incidence[t, users] = 1
        # each user's frequency, within 5 standard errors (family-wise over 50 users: < 1e-4 by chance)
        freq = incidence.mean(0)
        assert np.all(np.abs(freq - q) < 5 * math.sqrt(q * (1 - q) / draws))
        # pairwise independence: joint frequencies ~ q^2 (6 standard errors over 1225 pairs) and small correlations
        joint = (incidence.T @ incidence / draws)[np.triu_indices(num_users, 1)]
        assert np.all(np.abs(joint - q * q) < 6 * math.sqrt(q * q * (1 - q * q) / draws))
        corr = np.corrcoef(incidence.T)[np.triu_indices(num_users, 1)]
        assert np.abs(corr).max() < 0.08
        # batch sizes (in users) follow Binomial(U, q)
        sizes = incidence.sum(1)
        mean, var = num_users * q, num_users * q * (1 - q)
        assert abs(sizes.mean() - mean) < 4 * math.sqrt(var / draws)
        assert sizes.var() == pytest.approx(var, rel=0.1)

    @pytest.mark.parametrize("secure", [False, True])
    def test_inclusion_is_keyed_like_the_example_sampler(self, secure):
        # the users of draw k are the "examples" PoissonBatchSampler draws from (seed, k) over num_users
        user_ids = scattered_users([2, 1, 3] * 10)
        kwargs = dict(steps_per_epoch=6, seed=5, draw_offset=3, secure=secure)
        users = PoissonUserBatchSampler(user_ids, 0.3, 2, max_examples_per_user=2, **kwargs)
        examples = PoissonBatchSampler(users.num_users, 0.3, 2, **kwargs)
        for a, b in zip(users.logical_batches(), examples.logical_batches(), strict=True):
            assert a.tolist() == b.tolist()

    def test_secure_mode_differs_and_is_poisson(self):
        num_users, q, draws = 40, 0.2, 1500
        user_ids = scattered_users([1, 2, 5, 3] * 10, seed=2)
        kwargs = dict(steps_per_epoch=draws, max_examples_per_user=2, seed=3)
        plain = PoissonUserBatchSampler(user_ids, q, 1, **kwargs)
        secure = PoissonUserBatchSampler(user_ids, q, 1, secure=True, **kwargs)
        batches = list(secure.logical_batches())
        assert any(a.tolist() != b.tolist() for a, b in zip(batches, plain.logical_batches(), strict=True))
        incidence = np.zeros((draws, num_users))
        for t, users in enumerate(batches):
            incidence[t, users] = 1
        assert np.all(np.abs(incidence.mean(0) - q) < 5 * math.sqrt(q * (1 - q) / draws))
        sizes = incidence.sum(1)
        mean, var = num_users * q, num_users * q * (1 - q)
        assert abs(sizes.mean() - mean) < 4 * math.sqrt(var / draws)
        assert sizes.var() == pytest.approx(var, rel=0.15)
        corr = np.corrcoef(incidence.T)[np.triu_indices(num_users, 1)]
        assert np.abs(corr).max() < 0.15


class TestRows:
    @pytest.mark.parametrize("secure", [False, True])
    @pytest.mark.parametrize("k", [2, 3])
    def test_at_most_k_own_rows_per_user_in_one_contiguous_run(self, k, secure):
        row_counts = [1, 2, 5] * 8
        user_ids = scattered_users(row_counts, seed=k)
        sampler = PoissonUserBatchSampler(
            user_ids, 0.5, 3, steps_per_epoch=200, max_examples_per_user=k, seed=7, secure=secure
        )
        assert sampler.num_users == len(row_counts) and sampler.num_rows == len(user_ids)
        seen = set()
        for users, parts in zip(sampler.logical_batches(), per_draw(sampler), strict=True):
            assert len(parts) == 3
            seen.update(check_layout(sampler, user_ids, users, parts))
        assert seen == set(range(len(user_ids)))  # random subsets: every row of every user is trained on

    @pytest.mark.parametrize("secure", [False, True])
    @pytest.mark.parametrize("k", [1, 2])
    def test_row_subsets_are_uniform(self, k, secure):
        # user 0 owns rows 0..4 (the rows whose keys share their index with the users' inclusion uniforms): a subset
        # stream correlated with the inclusion stream would favour some rows of a sampled user.
        user_ids = np.array([0] * 5 + [1, 2, 3, 1, 2])
        draws = 3000
        sampler = PoissonUserBatchSampler(
            user_ids, 0.5, 1, steps_per_epoch=draws, max_examples_per_user=k, seed=9, secure=secure
        )
        subsets = {s: 0 for s in itertools.combinations(range(5), k)}
        for (part,) in per_draw(sampler):
            rows = tuple(sorted(r for r in part if user_ids[r] == 0))
            if rows:
                subsets[rows] += 1
        observed = np.array(list(subsets.values()))
        assert abs(observed.sum() - draws / 2) < 5 * math.sqrt(draws / 4)
        assert stats.chisquare(observed).pvalue > 1e-4

    def test_users_without_rows_are_allowed(self):
        user_ids = np.array([0, 2, 2, 4])
        sampler = PoissonUserBatchSampler(user_ids, 0.6, 2, steps_per_epoch=30, max_examples_per_user=1, seed=1)
        assert sampler.num_users == 5
        wider = PoissonUserBatchSampler(user_ids, 0.6, 2, max_examples_per_user=1, num_users=8)
        assert wider.num_users == 8 and wider.row_counts.tolist() == [1, 0, 2, 0, 1, 0, 0, 0]
        drew_empty = False
        for users, parts in zip(sampler.logical_batches(), per_draw(sampler), strict=True):
            check_layout(sampler, user_ids, users, parts)
            drew_empty |= bool({1, 3} & set(users.tolist()))
        assert drew_empty

    def test_rows_of(self):
        user_ids = scattered_users([3, 1, 4], seed=4)
        sampler = PoissonUserBatchSampler(user_ids, 0.5, 1, max_examples_per_user=2)
        for u in range(3):
            assert sampler.rows_of(u).tolist() == np.flatnonzero(user_ids == u).tolist()


class TestSharing:
    @pytest.mark.parametrize("secure", [False, True])
    @pytest.mark.parametrize("num_replicas", [2, 3])
    def test_ranks_share_whole_users_of_one_draw(self, num_replicas, secure):
        user_ids = scattered_users([1, 2, 5, 4] * 6, seed=num_replicas)
        kwargs = dict(steps_per_epoch=25, max_examples_per_user=3, seed=4, secure=secure)
        full = PoissonUserBatchSampler(user_ids, 0.4, 2, **kwargs)
        ranks = [
            PoissonUserBatchSampler(user_ids, 0.4, 2, num_replicas=num_replicas, rank=r, **kwargs)
            for r in range(num_replicas)
        ]
        full_draws = per_draw(full)
        rank_draws = [per_draw(s) for s in ranks]
        for t, users in enumerate(full.logical_batches()):
            shares = [sum(d[t], []) for d in rank_draws]
            union = sum(shares, [])
            assert sorted(union) == sorted(sum(full_draws[t], []))  # one draw, same rows
            assert len(set(union)) == len(union)  # disjoint
            owners = [set(user_ids[s].tolist()) for s in shares]
            for a, b in itertools.combinations(owners, 2):
                assert not a & b  # each user on exactly one rank
            for r, s in enumerate(ranks):
                check_layout(s, user_ids, users[r::num_replicas], rank_draws[r][t])

    def test_micro_batch_count_and_len(self):
        user_ids = scattered_users([1, 2, 5] * 3)
        for m in (1, 4, 7):
            sampler = PoissonUserBatchSampler(user_ids, 0.2, m, steps_per_epoch=9, max_examples_per_user=2, seed=2)
            assert len(sampler) == 9 * m
            assert all(len(parts) == m for parts in per_draw(sampler))
        assert PoissonUserBatchSampler(user_ids, 0.03, 1, max_examples_per_user=1).steps_per_epoch == 33

    def test_dataloader(self):
        user_ids = scattered_users([1, 2, 5] * 4)
        sampler = PoissonUserBatchSampler(user_ids, 0.5, 3, steps_per_epoch=4, max_examples_per_user=2, seed=6)
        assert sampler.sampler is sampler
        loader = DataLoader(list(range(len(user_ids))), batch_sampler=sampler, collate_fn=list)
        assert list(loader) == list(sampler)


class TestDeterminism:
    @pytest.mark.parametrize("secure", [False, True])
    def test_fixed_seed_and_fresh_continuations(self, secure):
        user_ids = scattered_users([1, 2, 5, 3] * 5)
        kwargs = dict(max_examples_per_user=2, seed=13, secure=secure)
        a = PoissonUserBatchSampler(user_ids, 0.3, 2, steps_per_epoch=10, **kwargs)
        b = PoissonUserBatchSampler(user_ids, 0.3, 2, steps_per_epoch=10, **kwargs)
        first = per_draw(a)
        assert per_draw(b) == first
        other = PoissonUserBatchSampler(user_ids, 0.3, 2, steps_per_epoch=10, **{**kwargs, "seed": 14})
        assert per_draw(other) != first
        # a later train() call (draw_offset) and the next epoch continue with the draws that follow, never replayed
        later = PoissonUserBatchSampler(user_ids, 0.3, 2, steps_per_epoch=5, draw_offset=5, **kwargs)
        assert per_draw(later) == first[5:]
        head = PoissonUserBatchSampler(user_ids, 0.3, 2, steps_per_epoch=5, **kwargs)
        assert per_draw(head) == first[:5]
        head.set_epoch(1)
        assert per_draw(head) == first[5:]
        assert first[5:] != first[:5]


def test_repr_hides_the_seed():
    seed = 987654321987654321
    sampler = PoissonUserBatchSampler([0, 1, 1], 0.5, 1, max_examples_per_user=1, seed=seed, secure=True)
    assert str(seed) not in repr(sampler) and "seed" not in repr(sampler)
    assert "num_users=2" in repr(sampler)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"user_ids": []}, ValueError),
        ({"user_ids": [[0, 1]]}, ValueError),
        ({"user_ids": [0, -1]}, ValueError),
        ({"user_ids": [0.0, 1.0]}, TypeError),
        ({"user_ids": ["a", "b"]}, TypeError),
        ({"max_examples_per_user": 0}, ValueError),
        ({"max_examples_per_user": 1.5}, ValueError),
        ({"sample_rate": 0.0}, ValueError),
        ({"sample_rate": 1.5}, ValueError),
        ({"num_micro_batches": 0}, ValueError),
        ({"rank": 2, "num_replicas": 2}, ValueError),
        ({"draw_offset": -1}, ValueError),
        ({"num_users": 2}, ValueError),
    ],
)
def test_bad_arguments(kwargs, error):
    args = {"user_ids": [0, 1, 2, 1], "sample_rate": 0.5, "num_micro_batches": 1, "max_examples_per_user": 1, **kwargs}
    with pytest.raises(error):
        PoissonUserBatchSampler(**args)


class TestEncodeUsers:
    def test_first_seen_codes(self):
        values = ["bob", "ann", "bob", 7, "cy", 7, "ann"]
        codes, num_users = encode_users(values)
        assert num_users == len(set(values))
        assert codes.dtype.kind == "i" and codes.min() == 0 and codes.max() == num_users - 1
        first = list(dict.fromkeys(values))
        assert [first[c] for c in codes] == values  # codes name the values, in first-seen order
        sampler = PoissonUserBatchSampler(codes, 1.0, 1, max_examples_per_user=len(values))
        assert sampler.num_users == num_users
        assert sorted(next(iter(sampler))) == list(range(len(values)))  # q = 1: everyone, every row

    @pytest.mark.parametrize("missing", [None, float("nan"), np.nan, np.float32("nan")])
    def test_missing_users_are_refused(self, missing):
        with pytest.raises(ValueError, match="Row 2 has no user"):
            encode_users(["a", "b", missing, "a"])

    def test_pandas_missing_values(self):
        pd = pytest.importorskip("pandas")
        for missing in (pd.NA, pd.NaT):
            with pytest.raises(ValueError, match="no user"):
                encode_users([1, missing])

    def test_unhashable_users_are_refused(self):
        with pytest.raises(TypeError, match="hashable"):
            encode_users(["a", ["b"]])
