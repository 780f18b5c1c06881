"""Guessing from scores, the choice of k+/k-, and the validity of the chosen bound under a known epsilon."""

import math

import numpy as np
import pytest

from hf_dp.audit import choose_guesses, count_correct, epsilon_lower_bound
from hf_dp.audit.guesses import guess_grid


class TestCounting:
    def test_top_and_bottom_guesses(self):
        scores = [5.0, -1.0, 3.0, 0.0, -2.0, 4.0]
        included = [True, False, False, True, False, True]
        # top 2 (5.0, 4.0): both in; bottom 2 (-2.0, -1.0): both out
        assert count_correct(scores, included, 2, 2) == (4, 4)
        # top 3 adds 3.0 (out: wrong); bottom 3 adds 0.0 (in: wrong)
        assert count_correct(scores, included, 3, 3) == (6, 4)
        assert count_correct(scores, included, 0, 1) == (1, 1)

    def test_ties_break_by_index_not_by_membership(self):
        scores = [1.0, 1.0, 1.0, 1.0]
        assert count_correct(scores, [False, True, True, True], 1, 0) == (1, 0)  # canary 0 first
        assert count_correct(scores, [True, False, False, False], 1, 0) == (1, 1)

    def test_too_many_guesses_raise(self):
        with pytest.raises(ValueError, match="k_plus \\+ k_minus <= m=3"):
            count_correct([1.0, 2.0, 3.0], [True, False, True], 2, 2)

    def test_non_finite_scores_raise(self):
        with pytest.raises(ValueError, match="finite"):
            count_correct([1.0, float("nan")], [True, False], 1, 0)


class TestSelection:
    def test_grid(self):
        grid = guess_grid(500)
        assert len(grid) == len(set(grid)) == 12
        assert all(kp >= 1 and (km == 0 or km == kp) and kp + km <= 500 for kp, km in grid)

    def test_bonferroni_is_the_best_pair_at_the_corrected_level(self):
        rng = np.random.default_rng(0)
        included = rng.random(300) < 0.5
        scores = rng.normal(size=300) + 2.0 * included
        choice = choose_guesses(scores, included, delta=1e-5)
        grid = guess_grid(300)
        expected = max(
            epsilon_lower_bound(300, *count_correct(scores, included, kp, km), 1e-5, 0.05 / len(grid))
            for kp, km in grid
        )
        assert choice.selection == "bonferroni" and choice.num_choices == len(grid)
        assert choice.epsilon_lower_bound == expected > 0
        assert (choice.r, choice.v) == count_correct(scores, included, choice.k_plus, choice.k_minus)

    def test_fixed_guesses_pay_nothing(self):
        rng = np.random.default_rng(1)
        included = rng.random(200) < 0.5
        scores = rng.normal(size=200) + 3.0 * included
        choice = choose_guesses(scores, included, delta=0.0, k_plus=40, k_minus=0)
        r, v = count_correct(scores, included, 40, 0)
        assert (choice.selection, choice.r, choice.v) == ("fixed", r, v)
        assert choice.epsilon_lower_bound == epsilon_lower_bound(200, r, v, 0.0)

    def test_split_uses_half_of_the_canaries(self):
        rng = np.random.default_rng(2)
        included = rng.random(301) < 0.5
        scores = rng.normal(size=301) + 3.0 * included
        choice = choose_guesses(scores, included, delta=1e-5, selection="split")
        assert choice.selection == "split" and choice.m == 151
        assert choice.epsilon_lower_bound > 0

    @pytest.mark.parametrize(
        "kwargs,match",
        [
            ({"selection": "best"}, "bonferroni"),
            ({"k_plus": 3}, "both"),
        ],
    )
    def test_bad_choices_raise(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            choose_guesses([1.0, 2.0, 3.0, 4.0], [True, False, True, False], delta=0.0, **kwargs)

    @pytest.mark.parametrize("selection", ["bonferroni", "split"])
    def test_valid_under_randomised_response(self, selection):
        """Each canary's score is epsilon-randomised response of its bit (exactly eps-DP per canary), so the bound
        may exceed eps = 1 in at most 5% of runs; and it must find a real signal (it is not always 0)."""
        eps, m, trials = 1.0, 200, 40
        rng = np.random.default_rng(3)
        bounds = []
        for t in range(trials):
            included = rng.random(m) < 0.5
            keep = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
            reported = np.where(keep, included, ~included)
            scores = reported + 0.01 * rng.random(m)  # independent tie-breaking: post-processing, still eps-DP
            bounds.append(choose_guesses(scores, included, delta=0.0, selection=selection, seed=t).epsilon_lower_bound)
        bounds = np.array(bounds)
        assert (bounds > eps).sum() <= 6  # P[Binomial(40, 0.05) >= 7] < 0.005
        assert (bounds > 0).mean() > 0.5
