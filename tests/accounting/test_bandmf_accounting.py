"""BandMF accounting: the amplified rule (DP-SGD at the part's rate for ceil(T / b) steps) against dp-accounting's
RDP and PLD accountants on that event, b = 1 as DP-SGD, calibration, and the unamplified Gaussian mechanism."""

import math

import pytest

from hf_dp.accounting import (
    banded_participations,
    banded_segments,
    epsilon,
    epsilon_banded,
    epsilon_banded_unamplified,
    noise_multiplier,
    sigma_for_banded,
)
from hf_dp.accounting.analysis.rdp import DEFAULT_ORDERS
from hf_dp.accounting.methods import segments_epsilon
from hf_dp.step.bandmf import optimize_banded_toeplitz

dp_accounting = pytest.importorskip("dp_accounting")


def dp_event(sigma, q, steps):
    """DP-SGD's event in dp-accounting: the Poisson-subsampled Gaussian, self-composed."""
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )


CASES = [(1.0, 0.04, 1000, 4, 1e-5), (0.8, 0.2, 130, 16, 1e-6), (2.0, 0.01, 999, 7, 1e-5)]


def test_participations():
    assert [banded_participations(t, 4) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert banded_participations(17, 1) == 17
    with pytest.raises(ValueError, match="bands"):
        banded_participations(10, 0)
    assert banded_segments(1.5, 0.1, 10, 4) == [(1.5, 0.1, 3)] and banded_segments(1.5, 0.1, 0, 4) == []


@pytest.mark.parametrize(("sigma", "q", "steps", "bands", "delta"), CASES)
def test_rdp_against_dp_accounting(sigma, q, steps, bands, delta):
    reference = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    reference.compose(dp_event(sigma, q, math.ceil(steps / bands)))
    assert epsilon_banded(sigma, q, steps, bands, delta, "rdp") == pytest.approx(reference.get_epsilon(delta), rel=1e-3)


@pytest.mark.parametrize(("sigma", "q", "steps", "bands", "delta"), CASES)
def test_prv_against_dp_accounting_pld(sigma, q, steps, bands, delta):
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    reference.compose(dp_event(sigma, q, math.ceil(steps / bands)))
    # PRV is within 0.5% above the tight value (its refinement budget); the fine PLD is close to tight.
    assert epsilon_banded(sigma, q, steps, bands, delta, "prv") == pytest.approx(reference.get_epsilon(delta), rel=2e-2)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_one_band_is_dp_sgd(accountant):
    assert epsilon_banded(1.1, 0.01, 500, 1, 1e-5, accountant) == epsilon(1.1, 0.01, 500, 1e-5, accountant)
    assert sigma_for_banded(2.0, 1e-5, 0.01, 500, 1, accountant) == noise_multiplier(2.0, 1e-5, 0.01, 500, accountant)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_calibration_round_trip(accountant):
    target, delta, q, steps, bands = 3.0, 1e-5, 0.05, 800, 8
    sigma = sigma_for_banded(target, delta, q, steps, bands, accountant)
    assert epsilon_banded(sigma, q, steps, bands, delta, accountant) <= target
    assert epsilon_banded(sigma * 0.99, q, steps, bands, delta, accountant) > target  # tight (1e-3 calibration)
    # with a past: the rest of the budget
    past = banded_segments(sigma, q, 300, bands)
    later = sigma_for_banded(target, delta, q, 500, bands, accountant, past=past)
    assert later > sigma  # the same budget over the same rounds, less left for the later ones
    assert segments_epsilon([*past, *banded_segments(later, q, 500, bands)], delta, accountant) <= target


def test_unamplified_is_the_gaussian_mechanism_of_the_sensitivity():
    strategy = optimize_banded_toeplitz(64, 8)
    sensitivity = strategy.sensitivity(participations=4, min_separation=16)
    assert sensitivity == pytest.approx(2.0)  # four full columns of norm 1, orthogonal
    reference = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    reference.compose(dp_accounting.GaussianDpEvent(3.0 / sensitivity))
    assert epsilon_banded_unamplified(3.0, sensitivity, 1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-3)
    with pytest.raises(ValueError, match="sensitivity"):
        epsilon_banded_unamplified(3.0, 0.0, 1e-5)
