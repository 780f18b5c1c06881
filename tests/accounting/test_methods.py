"""The accountant registry: which accountants exist, which are proven bounds, and argument checks."""

import math

import pytest

from hf_dp.accounting import ACCOUNTANTS, PROVEN_ACCOUNTANTS, check_proven_accountant, epsilon, noise_multiplier


def test_proven_accountants():
    assert PROVEN_ACCOUNTANTS == ("prv", "rdp")
    assert set(PROVEN_ACCOUNTANTS) < set(ACCOUNTANTS)
    assert "gdp" in ACCOUNTANTS  # still there, for logged estimates


def test_check_proven_accountant():
    for name in PROVEN_ACCOUNTANTS:
        check_proven_accountant(name)
    with pytest.raises(ValueError, match=r"'gdp'.*estimate.*under-estimate.*accountant=\"prv\".*accountant=\"rdp\""):
        check_proven_accountant("gdp")
    with pytest.raises(ValueError, match=r"\['gdp', 'prv', 'rdp'\]"):
        check_proven_accountant("moments")


def test_zero_noise_is_infinite_without_computing(monkeypatch):
    import hf_dp.accounting.methods as methods

    monkeypatch.setitem(methods.ACCOUNTANTS, "prv", lambda *a: pytest.fail("PRV must not be called"))
    assert epsilon(0.0, 0.1, 10, 1e-5, "prv") == math.inf
    assert epsilon(0.0, 0.1, 0, 1e-5, "rdp") == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"steps": -1}, "steps"),
        ({"steps": 1.5}, "steps"),
        ({"accountant": "moments"}, r"\['gdp', 'prv', 'rdp'\]"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ],
)
def test_epsilon_errors(kwargs, match):
    args = {"noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 10, "delta": 1e-5, **kwargs}
    with pytest.raises(ValueError, match=match):
        epsilon(**args)


@pytest.mark.parametrize("target", [0.0, -1.0, math.inf])
def test_target_epsilon_errors(target):
    with pytest.raises(ValueError, match="target_epsilon"):
        noise_multiplier(target, 1e-5, 0.01, 10)
