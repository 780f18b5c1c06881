"""The PRV accountant (``hf_dp.accounting.analysis.prv``): an upper bound on epsilon, within 2% of the tight value,
fast on long runs. Checked against dp-accounting's PLD, Opacus's PRV, prv-accountant's rigorous lower bound, the
analytic Gaussian mechanism and 50-digit arithmetic."""

import logging
import math
import time

import mpmath
import numpy as np
import pytest

from hf_dp.accounting import epsilon
from hf_dp.accounting.analysis import prv

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting.pld import pld_pmf, privacy_loss_mechanism  # noqa: E402

STEP_CASES = [(2.0, 1e-5), (1.0, 1e-3), (0.4, 0.1), (1.0, 1.0)]


def mp_hockey_stick(sigma, q, eps, direction):
    """delta(eps) of one step from its definition ``P(L > eps) - e^eps Q(L > eps)``, in 50-digit arithmetic."""
    mpmath.mp.dps = 50
    sigma, q, eps = mpmath.mpf(sigma), mpmath.mpf(q), mpmath.mpf(eps)
    phi = mpmath.ncdf
    if direction == "remove":  # P = (1-q) N(0) + q N(-1), Q = N(0); the loss exceeds eps left of x
        t = mpmath.exp(eps) - 1 + q
        if t <= 0:
            return 1 - mpmath.exp(eps)
        x = -(sigma**2) * mpmath.log(t / q) - mpmath.mpf(1) / 2
        return (1 - q) * phi(x / sigma) + q * phi((x + 1) / sigma) - mpmath.exp(eps) * phi(x / sigma)
    t = mpmath.exp(-eps) - 1 + q  # add: P = N(0), Q = (1-q) N(0) + q N(1)
    if t <= 0:
        return mpmath.mpf(0)
    x = sigma**2 * mpmath.log(t / q) + mpmath.mpf(1) / 2
    return phi(x / sigma) - mpmath.exp(eps) * ((1 - q) * phi(x / sigma) + q * phi((x - 1) / sigma))


def dp_accounting_loss(sigma, q, direction):
    adjacency = privacy_loss_mechanism.AdjacencyType.REMOVE if direction == "remove" else "add"
    if adjacency == "add":
        adjacency = privacy_loss_mechanism.AdjacencyType.ADD
    return privacy_loss_mechanism.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)


class TestOneStep:
    @pytest.mark.parametrize("direction", ["remove", "add"])
    @pytest.mark.parametrize("sigma,q", STEP_CASES)
    def test_hockey_stick_to_machine_precision(self, sigma, q, direction):
        loss = dp_accounting_loss(sigma, q, direction)
        bounds = loss.connect_dots_bounds()
        eps = np.linspace(bounds.epsilon_lower, bounds.epsilon_upper, 25)
        delta, excess = prv.step_hockey_stick(sigma, q, eps, direction)
        exact = np.array([float(mp_hockey_stick(sigma, q, e, direction)) for e in eps])
        exact_excess = np.array([float(mp_hockey_stick(sigma, q, e, direction) - (1 - mpmath.exp(e))) for e in eps])
        low = eps <= 0  # where the excess over 1 - e^eps is used
        np.testing.assert_allclose(delta, exact, rtol=1e-10, atol=1e-30)  # relative where it matters
        np.testing.assert_allclose(excess[low], exact_excess[low], rtol=1e-9, atol=1e-17)
        # Same quantity (and direction convention) as dp-accounting, which is accurate to ~1e-16 absolute.
        np.testing.assert_allclose(delta, loss.get_delta_for_epsilon(eps), rtol=0, atol=1e-14)

    @pytest.mark.parametrize("direction", ["remove", "add"])
    @pytest.mark.parametrize("sigma,q,interval", [(1.0, 1e-3, 1e-3), (0.4, 0.1, 1e-2), (2.0, 1e-5, 1e-6)])
    def test_connect_the_dots_is_dp_accountings(self, sigma, q, interval, direction):
        """Same PMF as dp-accounting's Algorithm 1 (to its own precision, ~1e-16 / h), but its mass stays 1."""
        loss = dp_accounting_loss(sigma, q, direction)
        bounds = loss.connect_dots_bounds()
        lower, upper = math.floor(bounds.epsilon_lower / interval), math.ceil(bounds.epsilon_upper / interval)
        deltas = loss.get_delta_for_epsilon(np.arange(lower, upper + 1) * interval)
        theirs = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lower, upper, deltas).to_dense_pmf()
        ours, mass_error = prv._step_pmf(sigma, q, interval, direction)
        probs, infinity_mass, losses = prv._dense(ours)
        their_probs, their_infinity_mass, their_losses = prv._dense(theirs)
        np.testing.assert_array_equal(losses, their_losses)
        np.testing.assert_allclose(probs, their_probs, rtol=0, atol=2e-15 / interval)
        assert infinity_mass == pytest.approx(their_infinity_mass, rel=1e-9, abs=1e-30)
        assert mass_error < 1e-14

    @pytest.mark.parametrize("sigma,q,steps,delta", [(0.7, 1e-5, 100_000, 1e-5), (1.0, 0.01, 1000, 1e-8)])
    def test_epsilon_extraction_is_dp_accountings(self, sigma, q, steps, delta):
        for direction in ("remove", "add"):
            composed = prv._composed(((sigma, q, steps),), 2.0**-12, direction)
            assert prv.pmf_epsilon(composed, delta) == pytest.approx(composed.get_epsilon_for_delta(delta), rel=1e-12)


class TestUpperBound:
    @pytest.mark.parametrize("sigma,steps", [(0.8, 1), (2.0, 1), (5.0, 100)])
    def test_full_batch_is_the_exact_gaussian_mechanism(self, sigma, steps, exact_gaussian_epsilon):
        """q = 1: N steps of sigma are one Gaussian mechanism with mu = sqrt(N) / sigma, known in closed form."""
        exact = exact_gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
        value = epsilon(sigma, 1.0, steps, 1e-5, "prv")
        assert exact <= value <= exact * 1.005

    @pytest.mark.parametrize(
        "segments,delta",
        [([(1.0, 0.01, 1000)], 1e-5), ([(0.7, 0.004, 5000)], 1e-8), ([(1.0, 0.01, 300), (2.0, 0.05, 200)], 1e-5)],
    )
    def test_same_grid_same_number_as_dp_accounting(self, segments, delta, pld_epsilon):
        """On a common grid both run the same pessimistic algorithm. dp-accounting's one-step PMF is accurate to
        ~1e-16 / h per point (ours to ~1e-16), which moves epsilon at delta = 1e-8 by ~1e-6 relative."""
        interval = 1e-3
        assert prv.prv_epsilon_at(segments, delta, interval) == pytest.approx(
            pld_epsilon(segments, delta, interval), rel=1e-5
        )

    @pytest.mark.parametrize(
        "sigma,q,steps,delta",
        [(1.0, 0.01, 1000, 1e-5), (2.0, 0.05, 200, 1e-5), (0.433, 1e-5, 100_000, 1e-5), (1.0, 1e-3, 10_000, 1e-8)],
    )
    def test_above_rigorous_lower_bound(self, sigma, q, steps, delta, prv_lower_bound):
        assert epsilon(sigma, q, steps, delta, "prv") >= prv_lower_bound(sigma, q, steps, delta)


class TestTightness:
    """Within 2% of the tightest independent upper bound (the issue's acceptance; we aim at 0.5%)."""

    @pytest.mark.parametrize(
        "sigma,q,steps,delta",
        [
            (1.0, 0.01, 1000, 1e-5),
            (0.7, 0.004, 5000, 1e-5),
            (2.0, 0.05, 200, 1e-8),
            (0.433, 1e-5, 100_000, 1e-5),  # the long run: we used to report 1.044
        ],
    )
    def test_against_dp_accounting_and_opacus(self, sigma, q, steps, delta, pld_epsilon, opacus_prv_epsilon):
        tight = min(pld_epsilon([(sigma, q, steps)], delta, 1e-4), opacus_prv_epsilon([(sigma, q, steps)], delta))
        assert epsilon(sigma, q, steps, delta, "prv") <= 1.02 * tight

    def test_million_steps(self, pld_epsilon):
        sigma, q, steps, delta = 0.8, 1e-3, 1_000_000, 1e-5
        value = epsilon(sigma, q, steps, delta, "prv")
        assert value <= 1.02 * pld_epsilon([(sigma, q, steps)], delta, 1e-4)
        assert value < epsilon(sigma, q, steps, delta, "rdp")

    def test_tiny_epsilon(self, pld_epsilon):
        """Small q, large sigma: epsilon ~ 0.004, where a fixed absolute error budget would be useless."""
        sigma, q, steps, delta = 2.0, 1e-5, 100_000, 1e-5
        value = epsilon(sigma, q, steps, delta, "prv")
        assert value <= 1.02 * pld_epsilon([(sigma, q, steps)], delta, 1e-7)


class TestHistory:
    def test_heterogeneous_segments(self, pld_epsilon):
        segments = [(1.0, 0.01, 300), (2.0, 0.05, 200), (1.0, 0.01, 100)]
        value = prv.prv_epsilon(segments, 1e-5)
        assert value <= 1.02 * pld_epsilon(segments, 1e-5, 1e-4)
        assert value >= prv.prv_epsilon([(1.0, 0.01, 400)], 1e-5)  # more steps only add privacy loss

    def test_pure_function_of_the_arguments(self, clear_prv_caches):
        """The grid depends on the history, not on what was asked before (so calibration can trust it)."""
        history = [(0.9, 0.02, 700)]
        fresh = prv.prv_epsilon(history, 1e-5)
        clear_prv_caches()
        for steps in (100, 600, 1024, 699):
            prv.prv_epsilon([(0.9, 0.02, steps)], 1e-5)
        assert prv.prv_epsilon(history, 1e-5) == fresh

    def test_growing_history_is_cheap(self, clear_prv_caches):
        """The trainer asks again after every step; the grid is refined once per power of two of the steps."""
        sigma, q, delta = 0.433, 1e-5, 1e-5
        epsilon(sigma, q, 70_000, delta, "prv")
        start = time.perf_counter()
        values = [epsilon(sigma, q, steps, delta, "prv") for steps in range(70_001, 70_006)]
        assert (time.perf_counter() - start) / len(values) < 2.0  # ~0.15 s each on 2 loaded cores
        assert values == sorted(values)

    def test_grid_limit_gives_a_looser_bound_and_warns(self, clear_prv_caches, monkeypatch, caplog):
        segments, delta = [(1.0, 1e-3, 10_000)], 1e-5
        tight = prv.prv_epsilon(segments, delta)
        clear_prv_caches()
        monkeypatch.setattr(prv, "PRV_MAX_STEP_POINTS", 3000)
        with caplog.at_level(logging.WARNING, logger=prv.__name__):
            loose = prv.prv_epsilon(segments, delta)
        assert "stopped the refinement" in caplog.text
        assert loose >= tight

    def test_fft_noise_is_covered(self):
        """At 1e6 steps the float64 FFT noise is a few % of delta = 1e-8: epsilon is taken at a delta reduced by it."""
        segments, delta = ((0.433, 1e-5, 1_000_000),), 1e-8
        interval = prv.prv_discretisation(segments, delta)["remove"]
        raw = prv.pmf_epsilon(prv._composed(segments, interval, "remove"), delta)
        covered = prv._direction_epsilon(segments, delta, interval, "remove")
        assert raw < covered < raw * 1.01

    def test_too_noisy_is_refused(self):
        with pytest.raises(ValueError, match=r'precisely enough for delta=1e-10.*accountant="rdp"'):
            epsilon(0.433, 1e-5, 1_000_000, 1e-10, "prv")
        assert math.isfinite(epsilon(0.433, 1e-5, 1_000_000, 1e-10, "rdp"))

    def test_no_privacy_and_no_steps(self):
        assert prv.prv_epsilon([(0.0, 0.1, 5)], 1e-5) == math.inf
        assert prv.prv_epsilon([(1.0, 0.1, 0)], 1e-5) == 0.0
