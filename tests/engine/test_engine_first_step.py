"""The first step of a plan, made cheaper without weakening it: each shortcut is checked here against the straight
computation it replaces (kept in this file as the reference), on the tiny transformers of ``tests/helpers/models.py``.

* probe runs: the hooks on every module registered once for both runs (and no use recorder on the second);
* ``flatten_call`` / ``flatten_output``: plain containers walked directly, in ``tree_flatten``'s order;
* ``same_values``: one comparison when every entry is finite;
* layouts: worked out when the plan reads them, the third probe run only if a layout read needs it;
* rule checks: one per group of identical modules, on the same comparison;
* the verification: hooks on the covering modules only, the engine's own book-keeping outside its use recorder.
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import models
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils._pytree import tree_flatten

from hf_dp import BookKeepingClipper, UnsupportedModuleError
from hf_dp.engine import proof as proof_module
from hf_dp.engine.batch import root_batch, slice_batch
from hf_dp.engine.layouts import MIXED, Layouts, needs_third_run
from hf_dp.engine.probe import (
    CallRecord,
    Prober,
    ProbeRun,
    UseRecorder,
    eval_mode,
    flatten_call,
    flatten_output,
    infer_layout,
    run_probe,
    same_values,
    tolerance,
)
from hf_dp.engine.rule_check import rule_disagreement
from hf_dp.engine.shared_checks import RuleChecks
from hf_dp.layers import Layout

MODELS = {
    "gpt2": (models.gpt2, models.causal_batches),
    "llama": (models.llama, models.causal_batches),
    "bert": (models.bert_classifier, models.classification_batches),
    "t5": (models.t5, models.seq2seq_batches),
    "opt": (models.opt, models.causal_batches),
}


def _inputs(name: str, batch: dict) -> dict:
    if name == "t5":
        labels = batch["labels"].clamp_min(0)
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "decoder_input_ids": labels}
    return {k: v for k, v in batch.items() if k != "labels"}


def _model_and_inputs(name: str):
    torch.manual_seed(0)
    build, batches = MODELS[name]
    model = build().double()
    return model, _inputs(name, batches()[0])


# ---------------------------------------------------------------------------------------------------- references
def _reference_run_probe(model, args, kwargs, params) -> ProbeRun:
    """The probe run as it was: a pre-hook (appended) and a post-hook (prepended) on every module."""
    calls, stack, counts, uses = [], [], {}, {}

    def pre(module, args, kwargs):
        ordinal = counts.get(id(module), 0)
        counts[id(module)] = ordinal + 1
        record = CallRecord(len(calls), module, stack[-1] if stack else None, ordinal, tuple(args), dict(kwargs))
        record.in_leaves = tree_flatten((tuple(args), dict(kwargs)))[0]
        calls.append(record)
        stack.append(record.index)

    def post(module, args, kwargs, output):
        if not stack or calls[stack[-1]].module is not module:
            return None
        record = calls[stack.pop()]
        record.output = output
        record.out_leaves = tree_flatten(output)[0]
        return output

    def on_use(p, func):
        if stack:
            where = uses.setdefault(p, [])
            if not where or where[-1] != stack[-1]:
                where.append(stack[-1])

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True, prepend=True))
    try:
        with eval_mode(model), torch.no_grad(), UseRecorder(params, on_use):
            output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return ProbeRun(calls, uses, output, frozenset(params))


def _reference_same_values(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach(), b.detach()
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    if a.numel() == 0:
        return True
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    inf_a, inf_b = torch.isinf(a), torch.isinf(b)
    if not torch.equal(inf_a, inf_b) or not torch.equal(a[inf_a], b[inf_b]):
        return False
    finite = ~(nan_b | inf_b)
    x, y = a[finite].double(), b[finite].double()
    if x.numel() == 0:
        return True
    scale = float(y.abs().max())
    return float((x - y).abs().max()) <= tolerance(a.dtype) * max(scale, 1e-30)


def _reference_pairwise(one, two, three):
    if len(one) != len(two):
        return [MIXED] * max(len(one), len(two), 1)
    out = []
    for j, (a, b) in enumerate(zip(one, two, strict=True)):
        layout = infer_layout(a, b)
        if (
            layout is MIXED
            and three is not None
            and len(three) == len(two)
            and isinstance(a, torch.Tensor) != (isinstance(b, torch.Tensor))
        ):
            layout = infer_layout(b, three[j], sizes=(2, 3))
        out.append(layout)
    return out


def _reference_layouts(one, two, three):
    """Every layout of every call, eagerly, and the rows per example, as the plan computed them before."""
    relevant = lambda m: any(id(p) in one.traced for p in m.parameters())  # noqa: E731
    sig_one = [((id(c.module), c.ordinal), c.index) for c in one.calls if relevant(c.module)]
    sig_two = [((id(c.module), c.ordinal), c.index) for c in two.calls if relevant(c.module)]
    assert [k for k, _ in sig_one] == [k for k, _ in sig_two]
    if three is not None and [((id(c.module), c.ordinal)) for c in three.calls if relevant(c.module)] != [
        k for k, _ in sig_two
    ]:
        three = None
    sig_three = [c for c in three.calls if relevant(c.module)] if three is not None else None
    inputs = [[MIXED] * max(len(c.in_leaves), 1) for c in one.calls]
    outputs = [[MIXED] * max(len(c.out_leaves), 1) for c in one.calls]
    for k, ((_, i), (_, j)) in enumerate(zip(sig_one, sig_two, strict=True)):
        c1, c2 = one.calls[i], two.calls[j]
        c3 = sig_three[k] if sig_three is not None else None
        inputs[i] = _reference_pairwise(c1.in_leaves, c2.in_leaves, c3.in_leaves if c3 else None)
        outputs[i] = _reference_pairwise(c1.out_leaves, c2.out_leaves, c3.out_leaves if c3 else None)
    rows = set()
    for call in one.calls:
        for leaf, layout in zip(
            call.in_leaves + call.out_leaves, inputs[call.index] + outputs[call.index], strict=False
        ):
            batched = isinstance(layout, Layout) and layout.dim == 0 and not layout.broadcast
            if batched and isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] > 1:
                rows.add(leaf.shape[0])
    return inputs, outputs, rows


def _leaf_summary(x):
    if isinstance(x, torch.Tensor):
        return (
            "tensor",
            tuple(x.shape),
            x.dtype,
            x.detach().double().sum().item() if x.is_floating_point() else x.sum().item(),
        )
    return (type(x).__name__, x if isinstance(x, int | float | str | bool | type(None)) else None)


def _run_summary(run: ProbeRun):
    calls = [
        (
            type(c.module).__name__,
            c.parent,
            c.ordinal,
            [_leaf_summary(x) for x in c.in_leaves],
            [_leaf_summary(x) for x in c.out_leaves],
        )
        for c in run.calls
    ]
    uses = {id(p): where for p, where in run.uses.items()}
    return calls, uses


# ---------------------------------------------------------------------------------------------------- flatten
class Pair(collections.namedtuple("Pair", "a b")):
    pass


def test_flatten_matches_tree_flatten():
    t = torch.arange(6.0).view(2, 3)
    packed = pack_padded_sequence(torch.randn(2, 3, 1), torch.tensor([3, 2]), batch_first=True)
    cases = [
        (t, None, 3, "x", 1.5, True),
        [t, [t, (None, t)], {"k": t, "j": [1, 2]}],
        {"b": t, "a": (t, None)},
        collections.OrderedDict([("z", t), ("y", None)]),
        Pair(t, [t]),
        (torch.Size([2, 3]), torch.float64, torch.device("cpu")),
        (packed, t),
        collections.defaultdict(list, {"q": [t]}),
    ]
    is_packed = lambda x: isinstance(x, type(packed))  # noqa: E731
    for case in cases:
        expected = tree_flatten(case, is_leaf=is_packed)[0]
        got = flatten_output(case)
        assert len(got) == len(expected) and all(x is y for x, y in zip(got, expected, strict=True))
    args, kwargs = (t, [t, None]), {"mask": None, "cache": {"k": t}, "packed": packed}
    expected = tree_flatten((args, kwargs), is_leaf=is_packed)[0]
    got = flatten_call(args, kwargs)
    assert len(got) == len(expected) and all(x is y for x, y in zip(got, expected, strict=True))


def test_flatten_of_a_model_output_matches_tree_flatten():
    model, inputs = _model_and_inputs("gpt2")
    with torch.no_grad():
        out = model(**inputs)
    expected = tree_flatten(out)[0]
    got = flatten_output(out)
    assert len(got) == len(expected) and all(x is y for x, y in zip(got, expected, strict=True))


# ---------------------------------------------------------------------------------------------------- same_values
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_same_values_matches_the_general_comparison(dtype):
    g = torch.Generator().manual_seed(0)
    tol = tolerance(dtype)
    for trial in range(200):
        a = torch.randn(5, 4, generator=g).to(dtype)
        b = a.clone()
        kind = trial % 8
        if kind == 1:
            b = b + (torch.randn(5, 4, generator=g) * tol * 0.5).to(dtype)
        elif kind == 2:
            b = b + (torch.randn(5, 4, generator=g) * tol * 5).to(dtype)
        elif kind == 3:
            a[1, 2] = b[1, 2] = float("inf")
        elif kind == 4:
            a[0, 0] = float("nan")
            b[0, 0] = float("nan")
        elif kind == 5:
            a[0, 0] = float("nan")
        elif kind == 6:
            a[2, 1], b[2, 1] = float("inf"), float("-inf")
        elif kind == 7 and dtype == torch.float64:
            a[0, 0], b[0, 0] = 1e308, -1e308  # the difference overflows
        assert same_values(a, b) == _reference_same_values(a, b), (trial, a, b)
    empty = torch.zeros(0, 3, dtype=dtype)
    assert same_values(empty, empty) and _reference_same_values(empty, empty)
    ints = torch.arange(6)
    assert same_values(ints, ints.clone()) and not same_values(ints, ints + 1)


# ---------------------------------------------------------------------------------------------------- probe runs
class ReadsInPreHook(nn.Module):
    """A module whose own pre-hook reads a parameter (weight normalisation done by hand): the use belongs to the
    enclosing call, the probe's pre-hook on the module running after the module's own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.g = nn.Parameter(torch.ones(4))
        self.fc.register_forward_pre_hook(lambda m, args: (args[0] * self.g,))
        self.shared = nn.Linear(4, 4)

    def forward(self, x, scale=None):
        h = self.fc(x)
        h = self.shared(h) + self.shared(torch.tanh(h))
        return h if scale is None else h * scale


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prober_records_what_per_module_hooks_recorded(float64, name):
    model, inputs = _model_and_inputs(name)
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    batch = root_batch(model, (), inputs)
    for rows in ([0], [1, 0]):
        args, kwargs = slice_batch((), inputs, batch, rows)
        got = run_probe(model, args, kwargs, params)
        expected = _reference_run_probe(model, args, kwargs, params)
        assert _run_summary(got) == _run_summary(expected)


def test_prober_with_own_pre_hooks_and_repeated_calls(float64):
    torch.manual_seed(0)
    model = ReadsInPreHook()
    params = {id(p): p for p in model.parameters()}
    x = torch.randn(2, 3, 4)
    for kwargs in ({}, {"scale": torch.tensor(2.0)}):
        got = run_probe(model, (x,), kwargs, params)
        expected = _reference_run_probe(model, (x,), kwargs, params)
        assert _run_summary(got) == _run_summary(expected)
        # the read of `g` in fc's own pre-hook is a use in the root call, not in fc's
        assert got.uses[model.g] == [0]


def test_probe_hooks_are_gone_after_a_failed_run():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(4, 4))
    with eval_mode(model), Prober(model) as prober, pytest.raises(RuntimeError):
        prober.run((torch.randn(2, 3),), {}, {id(p): p for p in model.parameters()})
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


# ---------------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("name", sorted(MODELS))
def test_lazy_layouts_match_the_eager_ones(float64, name):
    model, inputs = _model_and_inputs(name)
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    batch = root_batch(model, (), inputs)
    one = run_probe(model, *slice_batch((), inputs, batch, [0]), params)
    two = run_probe(model, *slice_batch((), inputs, batch, [1, 0]), params, uses=False)
    three = run_probe(model, *slice_batch((), inputs, batch, [1, 1, 0]), params, uses=False)
    assert needs_third_run(one, two)  # every model here builds its attention mask only when some row is padded
    ref_inputs, ref_outputs, ref_rows = _reference_layouts(one, two, three)
    made = []

    def make():
        made.append(1)
        return three

    lazy = Layouts(one, two, make)
    assert lazy.batched_rows() == ref_rows
    assert not made  # the rows per example never need the third run
    for i in range(len(one.calls)):
        assert lazy.outputs[i] == ref_outputs[i] and lazy.inputs[i] == ref_inputs[i], one.calls[i].module
    assert made == [1]
    eager = Layouts(one, two, three)
    assert eager.batched_rows() == ref_rows
    assert all(eager.inputs[i] == ref_inputs[i] and eager.outputs[i] == ref_outputs[i] for i in range(len(one.calls)))


def _plan_summary(plan, model):
    names = {id(p): n for n, p in model.named_parameters()}
    hooked = [(h.name, type(h.rule).__name__, sorted(names[id(p)] for p in h.params)) for h in plan.hooked]
    by_entry = {id(h): h.name for h in plan.hooked}
    calls = sorted(
        (by_entry[entry], ordinal, repr([(lay.outputs, lay.inputs, lay.expand, lay.drop, lay.shapes) for lay in v]))
        for (entry, ordinal), v in plan.calls.items()
    )
    shadows = sorted((by_entry[k], sorted(names[id(p)] for p in v)) for k, v in plan.shadowing.items())
    return hooked, calls, shadows, plan.repeats


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plan_is_the_same_with_the_third_run_made_when_read(float64, name, monkeypatch):
    """The plan built with the third run made up front and the one that makes it only when a layout needs it."""
    plans, runs = {}, {}
    run, build = Prober.run, proof_module.build_plan
    count = [0]
    eager = [False]

    def counting(self, *args, **kwargs):
        count[0] += 1
        return run(self, *args, **kwargs)

    def forced(*args, three=None, **kwargs):
        return build(*args, three=three() if eager[0] and callable(three) else three, **kwargs)

    monkeypatch.setattr(Prober, "run", counting)
    monkeypatch.setattr(proof_module, "build_plan", forced)
    for up_front in (True, False):
        model, inputs = _model_and_inputs(name)
        count[0], eager[0] = 0, up_front
        clipper = BookKeepingClipper(model, max_grad_norm=1.0)
        model(**inputs)
        plans[up_front], runs[up_front] = _plan_summary(clipper._plan, model), count[0]
        clipper.remove()
    assert plans[True] == plans[False]
    assert runs[True] == 3 and runs[False] in (2, 3)
    if name != "t5":  # T5's position bias is covered by its attention's fallback, which reads the mask
        assert runs[False] == 2


# ---------------------------------------------------------------------------------------------------- rule checks
class GainRMSNorm(nn.Module):
    """Named like an RMSNorm (so the RMSNorm rule is guessed for it), with a buffer its forward multiplies by: the
    guess holds for a gain of 1 and not otherwise."""

    def __init__(self, d, gain):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = 1e-6
        self.register_buffer("gain", torch.tensor(float(gain)))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight * self.gain


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _checks_of(model, x, monkeypatch):
    made = []
    original = RuleChecks.__init__

    def init(self):
        original(self)
        made.append(self)

    monkeypatch.setattr(RuleChecks, "__init__", init)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    model(x)
    rules = [(name, rule) for name, rule in clipper.hooked_modules]
    clipper.remove()
    return made[-1], rules


def test_identical_layers_share_one_rule_check(float64, monkeypatch):
    torch.manual_seed(0)
    model = Stack([nn.Linear(4, 4) for _ in range(4)] + [nn.Linear(4, 3), nn.LayerNorm(3), nn.LayerNorm(3)])
    checks, _ = _checks_of(model, torch.randn(3, 5, 4), monkeypatch)
    assert (checks.evaluated, checks.shared) == (3, 4)  # Linear(4, 4) once, Linear(4, 3), LayerNorm(3) once


def test_guessed_rules_are_checked_on_every_module(float64, monkeypatch):
    """A guessed rule (here the RMSNorm rule, by the class name) is checked module by module: identical modules that
    differ in a buffer their forward reads get each their own answer (the guess holds for a gain of 1 only)."""
    torch.manual_seed(0)
    model = Stack([GainRMSNorm(4, 1.0), GainRMSNorm(4, 1.0), GainRMSNorm(4, 2.0), GainRMSNorm(4, 1.0)])
    checks, rules = _checks_of(model, torch.randn(3, 5, 4), monkeypatch)
    assert (checks.evaluated, checks.shared) == (4, 0)
    assert rules == [
        ("layers.0", "RMSNormRule"),
        ("layers.1", "RMSNormRule"),
        ("layers.2", "FallbackRule"),
        ("layers.3", "RMSNormRule"),
    ]


class GroupRMSNorm(nn.Module):
    """Named like an RMSNorm (the RMSNorm rule is guessed for it) but normalising groups of the features separately
    (Qwen4-Exp's hyper-connection norm): the guessed rule holds only where every group has the same RMS, e.g. on
    copies of one hidden state."""

    def __init__(self, d, group_size):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.eps = 1e-6
        self.group_size = group_size

    def forward(self, x):
        h = x.reshape(*x.shape[:-1], -1, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.flatten(-2)


class Copies(nn.Module):
    def forward(self, x):
        return torch.cat([x, x], -1)


def test_a_guessed_rule_that_holds_by_coincidence_is_not_shared(float64, monkeypatch):
    """The first norm sees two copies of its input (the guessed rule holds there), the second an input whose groups
    differ (it does not): each module gets its own check, and the clipper is exact (the second is covered by the
    fallback). Sharing the first check with the second would leave the second's gradient wrong."""
    from helpers.oracle import check_clipper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Copies(), GroupRMSNorm(8, 4), nn.Linear(8, 8), GroupRMSNorm(8, 4))
    x = torch.randn(3, 5, 4)
    checks, rules = _checks_of(model, x, monkeypatch)
    assert dict(rules)["2"] == "RMSNormRule" and dict(rules)["4"] == "FallbackRule"
    r = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))

    def loss(model, batch):
        return (model(batch["x"]) * r).flatten(1).sum(1)

    check_clipper(model, [{"x": x}, {"x": x.flip(0)}], loss, mode="bk-mixopt")


def test_rule_checks_are_not_shared_across_token_ids(float64, monkeypatch):
    """Two embeddings of the same shape read different ids (integer inputs are part of what makes checks equal)."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Embedding(10, 4, padding_idx=0)
            self.b = nn.Embedding(10, 4, padding_idx=0)

        def forward(self, ids):
            return self.a(ids) + self.b(ids.flip(1)) + self.b(ids)

    torch.manual_seed(0)
    checks, _ = _checks_of(Two(), torch.tensor([[0, 1, 2], [3, 0, 4]]), monkeypatch)
    assert checks.evaluated == 2 and checks.shared == 0


def test_a_wrong_rule_is_found_on_every_model_of_the_zoo_shape(float64, monkeypatch):
    """A registered rule that is wrong (twice the gradient) is refused by the shared check as by each check."""
    from hf_dp.layers.linear import LinearRule

    original = LinearRule.per_example_grads

    def doubled(self, module, captured, grad_output, trainable):
        return original(self, module, captured, 2 * grad_output, trainable)

    monkeypatch.setattr(LinearRule, "per_example_grads", doubled)
    model, inputs = _model_and_inputs("llama")
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="disagrees with autograd"):
        model(**inputs)
    clipper.remove()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shared_rule_checks_give_each_module_the_answer_of_its_own(float64, name, monkeypatch):
    """Every module's own check (no sharing) agrees with the answer the shared checks gave it."""
    model, inputs = _model_and_inputs(name)
    answers = []
    original = RuleChecks.disagreements

    def record(self, checks):
        found = original(self, checks)
        for (entry, rule, call, layout), shared in zip(checks, found, strict=True):
            answers.append((entry.name, shared, rule_disagreement(entry, rule, call, layout)))
        return found

    monkeypatch.setattr(RuleChecks, "disagreements", record)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    model(**inputs)
    clipper.remove()
    assert answers and all((shared is None) == (own is None) for _, shared, own in answers), answers


# ---------------------------------------------------------------------------------------------------- verification
class TrainOnlyBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = self.act(h) + self.fc.bias  # a use outside `fc` that the eval-mode probe does not see
        return h


def test_the_verification_names_the_module_of_an_uncovered_use(float64):
    model = nn.Sequential(nn.Linear(4, 4), TrainOnlyBias()).train()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(
        UnsupportedModuleError, match=r"`1\.fc\.bias` is used by .* in the forward pass of `1` \(TrainOnlyBias\)"
    ):
        model(torch.randn(3, 4))
    clipper.remove()


def test_the_verified_forward_records_the_model_uses_only(float64, monkeypatch):
    """The engine's book-keeping in the hooks of the verified forward pass runs outside the use recorder: it sees
    the model's torch calls that take a trainable parameter, as many as a plain forward pass makes."""
    model, inputs = _model_and_inputs("llama")
    model.train()
    seen = []
    original = UseRecorder.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        if self.grad_mode_only and func is not torch.Tensor.requires_grad_:  # the engine's ghost differentiation
            seen.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(UseRecorder, "__torch_function__", counting)
    plain = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            plain.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        model(**inputs)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    model(**inputs)
    clipper.remove()
    assert len(seen) == len(plain), (len(seen), len(plain))


def test_first_step_is_exact_on_the_zoo_shapes(float64):
    """The whole first step (probes, rule checks, support check) then a second one, against the float64 oracle."""
    from helpers.oracle import check_clipper

    for name in ("llama", "bert"):
        build, batches = MODELS[name]
        loss = models.causal_loss if name == "llama" else models.classification_loss
        torch.manual_seed(0)
        check_clipper(build().double(), batches(), loss, mode="bk-mixopt")


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_the_probe_runs_are_freed_when_the_plan_is_made(float64, name, monkeypatch):
    """The probe's runs (every module call, with the tensors it took and returned) are freed by reference counting as
    soon as the plan is made: no reference cycle keeps them until the garbage collector's next pass."""
    import gc
    import weakref

    runs: list = []
    run = Prober.run

    def recording(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        runs.append(weakref.ref(out))
        runs.extend(weakref.ref(x) for c in out.calls for x in c.out_leaves if isinstance(x, torch.Tensor))
        return out

    monkeypatch.setattr(Prober, "run", recording)
    model, inputs = _model_and_inputs(name)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        clipper = BookKeepingClipper(model, max_grad_norm=1.0)
        logits = model(**inputs).logits
        alive = sum(r() is not None for r in runs)
        clipper.abandon()
        del logits
    finally:
        if was_enabled:
            gc.enable()
    clipper.remove()
    assert len(runs) > 2  # two runs and the tensors their calls returned were recorded
    assert alive == 0
