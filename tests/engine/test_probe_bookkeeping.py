"""The probe's bookkeeping made cheaper without weakening it: each shortcut checked against the straight computation
it replaces (kept in this file as the reference).

* ``RowTracker``: the same marks after every torch function, the same routed calls, on a toy MoE and tiny transformers;
* ``slice_batch``: the same sub-batch without flattening when every input is a leaf;
* ``eval_mode``: flags put back through a class's own ``__setattr__`` where it has one;
* ``kept_state``: attributes and buffers put back, untouched modules left alone.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import models
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from hf_dp.engine import routing
from hf_dp.engine.batch import RootBatch, root_batch, slice_batch
from hf_dp.engine.module_state import kept_state
from hf_dp.engine.probe import eval_mode, run_probe
from hf_dp.engine.routing import RowTracker


# ------------------------------------------------------------------------------------------------------ references
class _ReferenceTracker(RowTracker):
    """``RowTracker`` as it was: every step taken for every torch function."""

    def observe(self, func, args, kwargs, out):
        tensors = routing._tensors(args, kwargs)
        if not tensors and func not in routing._RANDOM:
            return
        outputs = routing._outputs(out)
        if func in routing._WRITES:
            target = args[0] if args else None
            routed = isinstance(target, Tensor) and self._has(self._routed, target)
        else:
            routed = any(self._has(self._routed, t) for t in tensors) or self._selects_by_value(func, args, kwargs)
        if routed:
            self._mark(self._routed, outputs)
        if func in routing._SHAPE_ONLY:
            return
        derived = func in routing._RANDOM or any(
            t.is_floating_point() or t.is_complex() or self._has(self._derived, t) for t in tensors
        )
        if derived:
            self._mark(self._derived, [t for t in outputs if not (t.is_floating_point() or t.is_complex())])

    def enter(self, index, parent, in_leaves):
        if parent in self.routed_calls or any(isinstance(x, Tensor) and self._has(self._routed, x) for x in in_leaves):
            self.routed_calls.add(index)

    def leave(self, index, out_leaves):
        if index not in self.routed_calls:
            for x in out_leaves:
                if isinstance(x, Tensor):
                    self._routed.pop(id(x), None)


_FOR_MODEL = RowTracker.for_model


def _live(marks: dict) -> set[int]:
    return {key for key, ref in marks.items() if ref() is not None}


class _Both:
    """The tracker and the reference side by side: the same marks after every step."""

    def __init__(self, model):
        self.new = _FOR_MODEL(model)
        self.old = _ReferenceTracker(self.new._tables)
        self.steps = 0

    @property
    def routed_calls(self):
        assert self.new.routed_calls == self.old.routed_calls
        return self.new.routed_calls

    def _same(self):
        self.steps += 1
        assert _live(self.new._derived) == _live(self.old._derived)
        assert _live(self.new._routed) == _live(self.old._routed)
        assert self.new.routed_calls == self.old.routed_calls

    def observe(self, *a):
        self.new.observe(*a)
        self.old.observe(*a)
        self._same()

    def enter(self, *a):
        self.new.enter(*a)
        self.old.enter(*a)
        self._same()

    def leave(self, *a):
        self.new.leave(*a)
        self.old.leave(*a)
        self._same()


class _Experts(nn.Module):
    """Top-1 routing of token rows to two experts (``x[rows]``, ``index_add_``), a random draw on routed rows."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2, bias=False)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        chosen = self.gate(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e in range(2):
            rows = (chosen == e).nonzero().squeeze(-1)
            picked = torch.index_select(flat, 0, rows) if e else flat[rows]
            out.index_add_(0, rows, self.experts[e](picked) * torch.rand_like(picked[:, :1]).ge(0).to(x.dtype))
        return out.view_as(x) + x[..., :1].gt(0).long().cumsum(-1).to(x.dtype)


@pytest.mark.parametrize("name", ["experts", "gpt2", "bert", "t5"])
def test_row_tracker_marks_as_the_reference(float64, name, monkeypatch):
    if name == "experts":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _Experts(), nn.Linear(4, 4)).double()
        inputs = {"input": torch.randn(2, 5, 4, dtype=torch.float64)}
    else:
        torch.manual_seed(0)
        build, batches = {
            "gpt2": (models.gpt2, models.causal_batches),
            "bert": (models.bert_classifier, models.classification_batches),
            "t5": (models.t5, models.seq2seq_batches),
        }[name]
        model = build().double()
        inputs = {k: v for k, v in batches()[0].items() if k != "labels" or name == "t5"}
    made: list[_Both] = []
    monkeypatch.setattr(RowTracker, "for_model", lambda model: made.append(_Both(model)) or made[-1])
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    batch = root_batch(model, (), inputs)
    run = run_probe(model, *slice_batch((), inputs, batch, [1, 0]), params)
    assert made and made[0].steps > 0
    assert (name == "experts") == bool(run.routed)


def _reference_slice(args, kwargs, batch, index):
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    out = list(leaves)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch.size:
            out[i] = leaf.index_select(0, torch.tensor(index, dtype=torch.long))
    new_args, new_kwargs = tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs)


def test_slice_batch_of_leaves_as_the_reference():
    x, mask, scalar = torch.randn(3, 2), torch.ones(3, 4, dtype=torch.long), torch.tensor(2.0)
    param = nn.Parameter(torch.randn(3, 5))
    cases = [
        ((x, None, 3), {"attention_mask": mask, "flag": True, "scale": scalar, "dtype": torch.float32}),
        ((), {"p": param, "other": torch.randn(2, 3), "name": "x"}),
        ((x, (mask, None)), {"nested": {"m": mask}}),  # not all leaves: the general path
    ]
    for args, kwargs in cases:
        for index in ([0], [1, 0], [2, 2, 0]):
            got = slice_batch(args, kwargs, RootBatch(3), index)
            expected = _reference_slice(args, kwargs, RootBatch(3), index)
            got_leaves, got_spec = tree_flatten(got)
            want_leaves, want_spec = tree_flatten(expected)
            assert got_spec == want_spec and type(got[0]) is tuple and list(got[1]) == list(expected[1])
            for a, b, given in zip(got_leaves, want_leaves, tree_flatten((args, kwargs))[0], strict=True):
                if b is given:  # passed unchanged
                    assert a is b
                else:
                    assert a is not given and a.shape == b.shape and torch.equal(a, b)


class _Logged(nn.Module):
    """A module whose own ``__setattr__`` logs every assignment."""

    log: list = []

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def __setattr__(self, name, value):
        type(self).log.append((name, value))
        super().__setattr__(name, value)


class _Mixin:
    def __setattr__(self, name, value):
        type(self).seen.append((name, value))
        object.__setattr__(self, name, value)


class _AfterModule(nn.Module, _Mixin):
    """``nn.Module.__setattr__`` ends in the mixin's (``super()`` past ``nn.Module``)."""

    seen: list = []

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


def test_eval_mode_puts_the_flags_back_through_a_class_own_setattr():
    model = nn.Sequential(_Logged(), _AfterModule(), nn.Dropout(0.5))
    model.train()
    model[1].fc.eval()
    flags = [(m, m.training) for m in model.modules()]
    _Logged.log.clear()
    _AfterModule.seen.clear()
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [(m, m.training) for m in model.modules()] == flags
    assert ("training", True) in _Logged.log and ("training", True) in _AfterModule.seen


def test_kept_state_puts_back_what_a_run_changed_only():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].eval()
    before = [dict(m.__dict__) for m in model.modules()]
    buffers = dict(model[1]._buffers)
    with kept_state(model) as modules:
        assert modules == list(model.modules())
        model[0].added = 1
        model[0].training = False
        model[1].register_buffer("running_mean", torch.ones(2))
        model[1].momentum = 0.5
    after = [dict(m.__dict__) for m in model.modules()]
    assert all(a.keys() == b.keys() and all(a[k] is b[k] for k in a) for a, b in zip(after, before, strict=True))
    assert all(model[1]._buffers[k] is v for k, v in buffers.items())
    assert weakref.ref(model) is not None
