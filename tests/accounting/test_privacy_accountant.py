"""``PrivacyAccountant``: segment history, checkpoint state, and a proven headline accountant."""

import pytest

from hf_dp.accounting import PrivacyAccountant, epsilon
from hf_dp.accounting.analysis.rdp import DEFAULT_ORDERS


def test_history_composes_segments(rdp_reference):
    acc = PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.01)
    acc.step(100)
    acc.step(50, noise_multiplier=2.0, sample_rate=0.02)
    acc.step(50)
    assert acc.steps == 200
    assert acc.history == [[1.0, 0.01, 100], [2.0, 0.02, 50], [1.0, 0.01, 50]]
    assert acc.epsilon(1e-5) > epsilon(1.0, 0.01, 150, 1e-5)  # the extra segment only adds privacy loss
    expected = rdp_reference([(1.0, 0.01, 150), (2.0, 0.02, 50)], 1e-5, DEFAULT_ORDERS)
    assert acc.epsilon(1e-5) == pytest.approx(expected, rel=1e-3)


def test_state_dict_round_trip():
    acc = PrivacyAccountant(noise_multiplier=1.1, sample_rate=0.03, accountant="prv")
    acc.step(7)
    other = PrivacyAccountant()
    other.load_state_dict(acc.state_dict())
    assert other.epsilon(1e-5) == acc.epsilon(1e-5)
    assert other.accountant == "prv" and other.steps == 7
    other.step()
    assert other.steps == 8


def test_gdp_is_not_a_headline():
    with pytest.raises(ValueError, match=r'GDP.*accountant="prv"'):
        PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.01, accountant="gdp")
    state = PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.01).state_dict()
    with pytest.raises(ValueError, match="GDP"):
        PrivacyAccountant().load_state_dict({**state, "accountant": "gdp"})


def test_gdp_estimate_per_call():
    acc = PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.01)
    acc.step(1000)
    assert acc.epsilon(1e-5, accountant="gdp") == epsilon(1.0, 0.01, 1000, 1e-5, "gdp")


def test_bad_history():
    with pytest.raises(ValueError, match=r"history\[0\]"):
        PrivacyAccountant().load_state_dict({"history": [[1.0, 0.01]]})
