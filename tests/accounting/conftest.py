"""Independent references for the accounting tests: dp-accounting (RDP, PLD), Opacus (PRV), prv-accountant (rigorous
lower bounds), and the analytic Gaussian mechanism."""

import math

import pytest
from scipy import optimize, stats

dp_accounting = pytest.importorskip("dp_accounting")


def dp_event(sigma, q, steps):
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    event = gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
    return dp_accounting.SelfComposedDpEvent(event, steps)


@pytest.fixture
def pld_epsilon():
    """dp-accounting's PLD accountant (pessimistic connect-the-dots, both directions) on the grid ``interval``."""

    def compute(segments, delta, interval):
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
        for sigma, q, steps in segments:
            accountant.compose(dp_event(sigma, q, steps))
        return accountant.get_epsilon(delta)

    return compute


@pytest.fixture
def rdp_reference():
    def compute(segments, delta, orders):
        accountant = dp_accounting.rdp.RdpAccountant(orders=list(orders))
        for sigma, q, steps in segments:
            accountant.compose(dp_event(sigma, q, steps))
        return accountant.get_epsilon(delta)

    return compute


@pytest.fixture
def opacus_prv_epsilon():
    """Opacus's PRV accountant: an upper bound, its estimate plus ``eps_error=0.01``."""
    accountants = pytest.importorskip("opacus.accountants")

    def compute(segments, delta):
        accountant = accountants.PRVAccountant()
        accountant.history = [(sigma, q, steps) for sigma, q, steps in segments]
        return float(accountant.get_epsilon(delta))

    return compute


@pytest.fixture
def prv_lower_bound():
    """prv-accountant's rigorous lower bound on epsilon (Gopi et al. 2021; long-double composition; remove
    direction, so it also bounds the maximum over both directions from below)."""
    prv_accountant = pytest.importorskip("prv_accountant")

    def compute(sigma, q, steps, delta, eps_error=0.05):
        mechanism = prv_accountant.PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)
        accountant = prv_accountant.PRVAccountant(
            prvs=[mechanism], max_self_compositions=[steps], eps_error=eps_error, delta_error=delta / 1000
        )
        return float(accountant.compute_epsilon(delta=delta, num_self_compositions=[steps])[0])

    return compute


@pytest.fixture
def exact_gaussian_epsilon():
    """Analytic Gaussian mechanism (Balle & Wang 2018): the exact epsilon of ``mu``-GDP, e.g. N steps of sigma at
    q = 1 (``mu = sqrt(N) / sigma``)."""

    def compute(mu, delta):
        def delta_of(eps):
            return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

        return optimize.brentq(lambda e: delta_of(e) - delta, 0, 200, xtol=1e-13)

    return compute


@pytest.fixture
def clear_prv_caches():
    """Forget every cached grid and PMF, so that a result can be compared with one computed from scratch."""
    from hf_dp.accounting.analysis import prv

    def clear():
        for cached in (prv._refine, prv._composed, prv._step_pmf):
            cached.cache_clear()

    clear()
    yield clear
    clear()
