"""The one-run bound (Steinke, Nasr and Jagielski 2023) against a direct float64 evaluation of its formula."""

import math

import pytest
from scipy import stats

from hf_dp.audit import epsilon_lower_bound, one_run_p_value


def reference_p_value(m, r, v, eps, delta):
    """The paper's p-value term by term: pmf sums, no tail functions, no cumulative tricks."""
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [float(stats.binom.pmf(k, r, q)) for k in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max((sum(pmf[v - i : v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, beta + 2 * m * delta * alpha)


CASES = [  # (m, r, v, delta)
    (1000, 100, 100, 0.0),
    (1000, 100, 90, 1e-5),
    (500, 200, 160, 1e-3),
    (256, 50, 45, 1e-4),
    (2000, 300, 200, 1e-6),
]


class TestBound:
    @pytest.mark.parametrize("m,r,v,delta", CASES)
    def test_bound_is_the_last_rejected_epsilon(self, m, r, v, delta):
        bound = epsilon_lower_bound(m, r, v, delta)
        assert bound > 0
        assert reference_p_value(m, r, v, bound, delta) < 0.05
        assert reference_p_value(m, r, v, bound + 1e-4, delta) >= 0.05

    @pytest.mark.parametrize("m,r,v,delta", CASES)
    @pytest.mark.parametrize("eps", [0.0, 0.7, 2.5])
    def test_p_value_matches_the_formula(self, m, r, v, delta, eps):
        assert one_run_p_value(m, r, v, epsilon=eps, delta=delta) == pytest.approx(
            reference_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-300
        )

    @pytest.mark.parametrize("r", [20, 100, 400])
    def test_all_right_without_delta_has_a_closed_form(self, r):
        # v = r, delta = 0: p = q^r, so the bound solves q^r = significance.
        q = 0.05 ** (1 / r)
        assert epsilon_lower_bound(10 * r, r, r, 0.0) == pytest.approx(math.log(q / (1 - q)), abs=1e-5)

    def test_monotone_in_correct_guesses(self):
        bounds = [epsilon_lower_bound(500, 200, v, 1e-5) for v in range(100, 201, 5)]
        assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:], strict=False))
        assert bounds[0] == 0.0 and bounds[-1] > 2

    def test_monotone_in_delta(self):
        bounds = [epsilon_lower_bound(1000, 200, 180, d) for d in (0.0, 1e-6, 1e-4, 1e-3)]
        assert all(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:], strict=False))
        assert bounds[-1] < bounds[0]

    @pytest.mark.parametrize("r", [10, 101, 500])
    def test_zero_at_chance(self, r):
        v = r // 2
        sd = math.sqrt(r) / 2
        assert epsilon_lower_bound(1000, r, v, 1e-5) == 0.0
        assert epsilon_lower_bound(1000, r, min(r, round(v + sd)), 1e-5) == 0.0  # one standard deviation

    def test_large_delta_rejects_nothing(self):
        # 2 m delta = 5.12: the delta term alone keeps p above the level even at eps = 0.
        assert reference_p_value(256, 50, 45, 0.0, 1e-2) >= 0.05
        assert epsilon_lower_bound(256, 50, 45, 1e-2) == 0.0
        assert epsilon_lower_bound(256, 50, 45, 0.0) > 1

    def test_no_guesses_or_no_right_guesses(self):
        assert epsilon_lower_bound(100, 0, 0, 1e-5) == 0.0
        assert epsilon_lower_bound(100, 10, 0, 1e-5) == 0.0

    def test_stricter_significance_gives_a_lower_bound(self):
        assert epsilon_lower_bound(500, 100, 95, 1e-5, 0.01) < epsilon_lower_bound(500, 100, 95, 1e-5, 0.05)

    @pytest.mark.parametrize(
        "args,match",
        [((10, 5, 6, 0.0), "v <= r <= m"), ((10, 11, 3, 0.0), "v <= r <= m"), ((10, 5, 3, 2.0), "delta")],
    )
    def test_bad_inputs_raise(self, args, match):
        with pytest.raises(ValueError, match=match):
            epsilon_lower_bound(*args)

    def test_bad_significance_raises(self):
        with pytest.raises(ValueError, match="significance"):
            epsilon_lower_bound(10, 5, 5, 0.0, significance=0.0)
