"""RDP (and the published numbers every accountant must reproduce), checked against dp-accounting and the analytic
Gaussian mechanism."""

import math

import pytest

from hf_dp.accounting import epsilon, noise_multiplier
from hf_dp.accounting.analysis.rdp import DEFAULT_ORDERS

CASES = [(1.0, 0.01, 1000), (0.7, 0.004, 5000), (2.0, 0.05, 200), (1.2, 1.0, 3)]


@pytest.mark.parametrize("sigma", [0.8, 1.0, 2.0])
def test_single_gaussian_step_is_above_exact(sigma, exact_gaussian_epsilon):
    assert exact_gaussian_epsilon(1 / sigma, 1e-5) <= epsilon(sigma, 1.0, 1, 1e-5, "rdp")


@pytest.mark.parametrize("sigma,q,steps", CASES)
def test_rdp_matches_dp_accounting(sigma, q, steps, rdp_reference):
    expected = rdp_reference([(sigma, q, steps)], 1e-5, DEFAULT_ORDERS)
    assert epsilon(sigma, q, steps, 1e-5, "rdp") == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("name,n", [("MNLI", 392702), ("QQP", 363846)])
def test_li_et_al_table(name, n):
    """Li et al. (2022), Table 1: sigma calibrated by RDP to eps=3; GDP-CLT and PRV of the same run."""
    q = 1024 / 67349
    steps = math.ceil(18 / q)
    delta = 1 / (2 * n)
    sigma = noise_multiplier(3.0, delta, q, steps, "rdp")
    assert epsilon(sigma, q, steps, delta, "gdp") == pytest.approx(2.52, abs=0.03)
    assert epsilon(sigma, q, steps, delta, "prv") == pytest.approx(2.75, abs=0.03)
