"""Accounting checked against independent libraries (dp-accounting), the exact Gaussian mechanism and a
published table."""

import math
import subprocess
import sys

import pytest
from scipy import optimize, stats

from hf_dp.accounting import PrivacyAccountant, epsilon, noise_multiplier
from hf_dp.accounting.analysis.prv import prv_epsilon_bounds
from hf_dp.accounting.analysis.rdp import DEFAULT_ORDERS

dp_accounting = pytest.importorskip("dp_accounting")

CASES = [(1.0, 0.01, 1000), (0.7, 0.004, 5000), (2.0, 0.05, 200), (1.2, 1.0, 3)]


def _dp_event(sigma, q, steps):
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    event = gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
    return dp_accounting.SelfComposedDpEvent(event, steps)


def exact_gaussian_epsilon(sigma, delta):
    """Analytic Gaussian mechanism (Balle & Wang 2018): the exact (eps, delta) curve of one step with q = 1."""

    def delta_of(eps):
        return stats.norm.cdf(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * stats.norm.cdf(
            -eps * sigma - 1 / (2 * sigma)
        )

    return optimize.brentq(lambda e: delta_of(e) - delta, 0, 100, xtol=1e-12)


class TestAgainstReferences:
    @pytest.mark.parametrize("sigma", [0.8, 1.0, 2.0])
    def test_single_gaussian_step(self, sigma):
        delta = 1e-5
        exact = exact_gaussian_epsilon(sigma, delta)
        assert exact <= epsilon(sigma, 1.0, 1, delta, "rdp")
        lower, _, upper = prv_epsilon_bounds([(sigma, 1.0, 1)], delta)
        assert lower <= exact <= upper

    @pytest.mark.parametrize("sigma,q,steps", CASES)
    def test_rdp_matches_dp_accounting(self, sigma, q, steps):
        delta = 1e-5
        ref = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
        ref.compose(_dp_event(sigma, q, steps))
        expected = ref.get_epsilon(delta)
        assert epsilon(sigma, q, steps, delta, "rdp") == pytest.approx(expected, rel=1e-3)

    @pytest.mark.parametrize("sigma,q,steps", CASES[:3])
    def test_prv_brackets_dp_accounting_pld(self, sigma, q, steps):
        delta = 1e-5
        ref = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        ref.compose(_dp_event(sigma, q, steps))
        pld = ref.get_epsilon(delta)
        lower, _, upper = prv_epsilon_bounds([(sigma, q, steps)], delta)
        assert lower <= pld + 2e-3 and pld <= upper + 2e-3  # PLD's own discretisation is pessimistic by <= 1e-3
        assert upper - lower < 0.05 * upper

    @pytest.mark.parametrize("name,n", [("MNLI", 392702), ("QQP", 363846)])
    def test_li_et_al_table(self, name, n):
        """Li et al. (2022), Table 1: sigma calibrated by RDP to eps=3; GDP-CLT and PRV of the same run."""
        q = 1024 / 67349
        steps = math.ceil(18 / q)
        delta = 1 / (2 * n)
        sigma = noise_multiplier(3.0, delta, q, steps, "rdp")
        assert epsilon(sigma, q, steps, delta, "gdp") == pytest.approx(2.52, abs=0.03)
        assert epsilon(sigma, q, steps, delta, "prv") == pytest.approx(2.75, abs=0.03)


class TestCalibration:
    @pytest.mark.parametrize("accountant", ["rdp", "gdp", "prv"])
    @pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
    def test_round_trip_is_tight(self, accountant, target):
        delta, q, steps = 1e-5, 0.02, 500
        sigma = noise_multiplier(target, delta, q, steps, accountant)
        assert epsilon(sigma, q, steps, delta, accountant) <= target
        assert epsilon(sigma * 0.99, q, steps, delta, accountant) > target  # within 1% of the smallest sigma

    def test_unreachable_target(self):
        with pytest.raises(ValueError, match="No noise multiplier"):
            noise_multiplier(1e-7, 1e-5, 1.0, 10**6, "rdp")


class TestStatefulAccountant:
    def test_history_composes_segments(self):
        acc = PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.01)
        acc.step(100)
        acc.step(50, noise_multiplier=2.0, sample_rate=0.02)
        acc.step(50)
        assert acc.steps == 200
        assert acc.history == [[1.0, 0.01, 100], [2.0, 0.02, 50], [1.0, 0.01, 50]]
        merged = epsilon(1.0, 0.01, 150, 1e-5)  # the noisier segment only adds privacy loss
        assert acc.epsilon(1e-5) > merged
        ref = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
        ref.compose(_dp_event(1.0, 0.01, 150))
        ref.compose(_dp_event(2.0, 0.02, 50))
        assert acc.epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-3)

    def test_state_dict_round_trip(self):
        acc = PrivacyAccountant(noise_multiplier=1.1, sample_rate=0.03, accountant="gdp")
        acc.step(7)
        other = PrivacyAccountant()
        other.load_state_dict(acc.state_dict())
        assert other.epsilon(1e-5) == acc.epsilon(1e-5) and other.accountant == "gdp" and other.steps == 7
        other.step()
        assert other.steps == 8

    def test_zero_noise_is_infinite_without_prv(self, monkeypatch):
        import hf_dp.accounting.methods as methods

        monkeypatch.setitem(methods.ACCOUNTANTS, "prv", lambda *a: pytest.fail("PRV must not be called"))
        assert epsilon(0.0, 0.1, 10, 1e-5, "prv") == math.inf
        assert epsilon(0.0, 0.1, 0, 1e-5, "rdp") == 0.0


class TestBadInput:
    @pytest.mark.parametrize(
        "kwargs,match",
        [
            ({"delta": 0.0}, "delta"),
            ({"delta": 1.0}, "delta"),
            ({"sample_rate": 0.0}, "sample_rate"),
            ({"sample_rate": 1.5}, "sample_rate"),
            ({"steps": -1}, "steps"),
            ({"accountant": "moments"}, r"\['gdp', 'prv', 'rdp'\]"),
            ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ],
    )
    def test_epsilon_errors(self, kwargs, match):
        args = {"noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 10, "delta": 1e-5, **kwargs}
        with pytest.raises(ValueError, match=match):
            epsilon(**args)

    @pytest.mark.parametrize("target", [0.0, -1.0, math.inf])
    def test_target_epsilon_errors(self, target):
        with pytest.raises(ValueError, match="target_epsilon"):
            noise_multiplier(target, 1e-5, 0.01, 10)


def test_cli():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_dp.accounting",
            "--noise-multiplier",
            "1.0",
            "--sample-rate",
            "0.01",
            "--steps",
            "1000",
            "--delta",
            "1e-5",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert {line.split("\t")[0] for line in out.strip().splitlines()} == {"gdp", "prv", "rdp"}
    rdp_line = next(line for line in out.splitlines() if line.startswith("rdp"))
    assert float(rdp_line.split("=")[1]) == pytest.approx(epsilon(1.0, 0.01, 1000, 1e-5), abs=1e-4)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_dp.accounting",
            "--target-epsilon",
            "3",
            "--sample-rate",
            "0.01",
            "--steps",
            "1000",
            "--delta",
            "1e-5",
            "--accountants",
            "rdp",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("rdp\tnoise_multiplier=")


def test_prv_small_noise_regime_coarsens_the_mesh():
    """prv-accountant rejects fine meshes for small sigma; the bounds must still come back and bracket PLD."""
    sigma, q, steps, delta = 0.5834805261409631, 0.1, 16, 1 / 4000
    lower, _, upper = prv_epsilon_bounds([(sigma, q, steps)], delta)
    ref = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    ref.compose(_dp_event(sigma, q, steps))
    pld = ref.get_epsilon(delta)
    assert lower - 2e-3 <= pld <= upper + 2e-3
    assert upper <= epsilon(sigma, q, steps, delta, "rdp")
