"""The peer harness classifies outcomes correctly: a wrong engine is caught, a refusal is recognised only when hf_dp
raises it, and a graph left in ``p.grad`` is reported (so an "exact" in the table means exact)."""

import harness
import pytest
import torch
from harness import EXACT, REFUSED, Case, run_case
from probes import floats, layer_case, probe_loss
from torch import nn

from hf_dp import BookKeepingClipper

LINEAR = layer_case(lambda: nn.Linear(4, 3), floats((4, 2, 4), (3, 2, 4)))


class _ScaledNorms(BookKeepingClipper):
    """An engine whose norms are 0.1% high: the silent class the harness must catch."""

    def backward(self, per_example_loss):
        coef = super().backward(per_example_loss)
        self.per_example_norms = self.per_example_norms * 1.001
        return coef


class _ZeroBias(BookKeepingClipper):
    """An engine with exact norms whose clipped sum misses one parameter (a zero gradient, not ``None``)."""

    def backward(self, per_example_loss):
        coef = super().backward(per_example_loss)
        self.model.layer.bias.grad.zero_()
        return coef


class _GraphInGrad(BookKeepingClipper):
    """An engine whose p.grad requires grad (exact numbers)."""

    def backward(self, per_example_loss):
        coef = super().backward(per_example_loss)
        for p in self.model.parameters():
            p.grad = p.grad.detach() + 0 * p
        return coef


def test_exact_engine_is_exact():
    assert run_case(LINEAR, "bk") == EXACT


def test_wrong_norms_are_caught(monkeypatch):
    monkeypatch.setattr(harness, "BookKeepingClipper", _ScaledNorms)
    with pytest.raises(AssertionError, match=r"WRONG \(norms max rel err 1\.0e-03, clipped sum rel err \d"):
        run_case(LINEAR, "bk")


def test_missing_clipped_sum_is_caught(monkeypatch):
    monkeypatch.setattr(harness, "BookKeepingClipper", _ZeroBias)
    with pytest.raises(AssertionError, match=r"WRONG \(norms max rel err .*layer\.bias: rel err 1\.0e\+00"):
        run_case(LINEAR, "per-sample")


def test_graph_in_grad_is_caught(monkeypatch):
    monkeypatch.setattr(harness, "BookKeepingClipper", _GraphInGrad)
    with pytest.raises(AssertionError, match="GRAPH"):
        run_case(LINEAR, "bk-mixopt")


def test_refusal_by_hf_dp_is_recognised():
    case = layer_case(lambda: nn.BatchNorm1d(4), floats((4, 4, 3), (3, 4, 3)), refusable="BatchNorm")
    outcome = run_case(case, "bk")
    assert outcome.startswith(REFUSED) and "BatchNorm" in outcome


class _Picky(nn.Module):
    """A model that raises ValueError itself for small batches: not a refusal by hf_dp."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] < 4 and torch.is_grad_enabled() and not self.fc.weight.requires_grad:
            raise ValueError("model input check")
        return self.fc(x)


def test_model_value_error_is_not_a_refusal():
    case = Case(build=_Picky, batches=floats((3, 2, 4), (3, 2, 4)), loss_fn=probe_loss())
    with pytest.raises(ValueError, match="model input check"):
        run_case(case, "bk")
