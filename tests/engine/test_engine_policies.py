"""Clipping policies (group-wise clipping, automatic clipping) and the gradient sink, against a float64 oracle.

The oracle differentiates each example's loss with plain autograd, splits the gradient into the clipping groups,
clips group ``g`` at ``C_g = C / sqrt(G)`` with the same formula (``min(1, C_g / (||g_{i,g}|| + 1e-6))`` or
``C_g / (||g_{i,g}|| + gamma)``) and sums. The groups it uses are the engine's (``clipper.group_names``); what the
groups are is checked separately against hand-written expectations.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import (
    bert_classifier,
    causal_batches,
    causal_loss,
    classification_batches,
    classification_loss,
    gpt2,
    llama,
    llama_lora,
)
from helpers.oracle import assert_rel_close, oracle_per_example
from torch import nn

from hf_dp import BookKeepingClipper

MODES = ["bk", "bk-mixopt", "per-sample"]
FNS = ["abadi", "automatic"]
GAMMA = 0.05

# model -> (factory, batches, loss, custom groups of name patterns)
POLICY_MODELS = {
    "gpt2-tied": (
        gpt2,
        causal_batches,
        causal_loss,
        [["*wte*", "*wpe*"], ["*.h.0.*"], ["*.h.1.*", "*ln_f*"]],  # lm_head.weight is wte's: matched by "*wte*"
    ),
    "bert-classifier": (
        bert_classifier,
        classification_batches,
        classification_loss,
        [["*embeddings*"], ["*encoder*"], ["*pooler*", "classifier*"]],
    ),
    "llama": (
        llama,
        causal_batches,
        causal_loss,
        [["*embed_tokens*", "*layers.0.*"], ["*layers.1.*", "model.norm.weight"], ["lm_head*"]],
    ),
    "llama-lora": (
        llama_lora,
        causal_batches,
        causal_loss,
        [["*lora_A*", "*lora_embedding_A*"], ["*lora_B*", "*lora_embedding_B*", "*lm_head*"]],
    ),
}
STYLES = ["all-layer", "layer-wise", "param-wise", "groups"]


def group_oracle(model, batches, loss_fn, groups: list[list[str]], c: float | None, fn: str, gamma: float = GAMMA):
    """Per batch the ``[G, B]`` group norms, the accumulated group-clipped sum per parameter name, and ``C``
    (``c=None``: the median group norm of the first batch times ``sqrt(G)``, so that some groups are clipped)."""
    ref = copy.deepcopy(model)
    of = {name: g for g, names in enumerate(groups) for name in names}
    per_batch = []
    for batch in batches:
        names, grads = oracle_per_example(ref, batch, loss_fn)
        assert set(names) == set(of), "every trainable parameter is in exactly one group"
        norms = torch.zeros(len(groups), len(grads), dtype=torch.float64)
        for i, gi in enumerate(grads):
            for name, g in zip(names, gi, strict=True):
                norms[of[name], i] += (g.double() ** 2).sum()
        per_batch.append((names, grads, norms.sqrt()))
    if c is None:
        c = float(per_batch[0][2].flatten().median()) * len(groups) ** 0.5
    c_g = c / len(groups) ** 0.5
    total = None
    for names, grads, norms in per_batch:
        coef = c_g / (norms + gamma) if fn == "automatic" else (c_g / (norms + 1e-6)).clamp(max=1.0)
        summed = [sum(coef[of[n], i] * grads[i][k] for i in range(len(grads))) for k, n in enumerate(names)]
        total = summed if total is None else [a + b for a, b in zip(total, summed, strict=True)]
    return [norms for _, _, norms in per_batch], dict(zip(per_batch[0][0], total, strict=True)), c


def _style(name: str, style: str):
    return POLICY_MODELS[name][3] if style == "groups" else style


_CASES: dict = {}


def policy_case(name: str):
    """Model (float64, eval) and batches, once per session."""
    if name not in _CASES:
        factory, batches, loss_fn, _ = POLICY_MODELS[name]
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(0)
        _CASES[name] = (factory().double().eval(), batches(), loss_fn)
        torch.set_default_dtype(previous)
    return _CASES[name]


def check_policy(model, batches, loss_fn, *, mode, style, fn, checkpointing=None, grad_sink=None):
    """Run the clipper on ``batches`` and compare norms, group norms and ``p.grad`` with the group oracle."""
    model = copy.deepcopy(model)
    probe = BookKeepingClipper(model, max_grad_norm=1.0, clipping_style=style)
    groups = probe.group_names
    probe.remove()
    norms, sums, c = group_oracle(model, batches, loss_fn, groups, None, fn)
    if fn == "abadi":
        assert any(bool((n > c / len(groups) ** 0.5).any()) for n in norms), "the test must clip some groups"
    if checkpointing is not None:
        checkpointing(model)
        model.train()  # checkpointing runs in training only; the models have no dropout
    clipper = BookKeepingClipper(
        model, max_grad_norm=c, mode=mode, clipping_style=style, clipping_fn=fn, gamma=GAMMA, grad_sink=grad_sink
    )
    assert clipper.group_names == groups
    for batch, expected in zip(batches, norms, strict=True):
        coef = clipper.backward(loss_fn(model, batch))
        assert coef.shape == ((len(batch["input_ids"]),) if len(groups) == 1 else expected.shape)
        torch.testing.assert_close(clipper.per_group_norms, expected, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(clipper.per_example_norms, expected.pow(2).sum(0).sqrt(), rtol=1e-6, atol=1e-12)
    if grad_sink is None:
        params = dict(model.named_parameters())
        scale = float(torch.sqrt(sum((g**2).sum() for g in sums.values())))
        for name, expected in sums.items():
            assert params[name].grad is not None, f"{name} got no gradient"
            assert_rel_close(params[name].grad, expected, 1e-6, name, scale)
    clipper.remove()
    return sums, c


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(POLICY_MODELS))
def test_policy_matches_group_oracle(float64, name, mode, style, fn):
    model, batches, loss_fn = policy_case(name)
    check_policy(model, batches, loss_fn, mode=mode, style=_style(name, style), fn=fn)


def test_ghost_mode_takes_automatic_clipping(float64):
    model, batches, loss_fn = policy_case("gpt2-tied")
    check_policy(model, batches, loss_fn, mode="ghost", style="all-layer", fn="automatic")


def _names(clipper) -> list[set[str]]:
    return [set(g) for g in clipper.group_names]


def test_layer_wise_groups_follow_modules_and_ties():
    model = gpt2()  # tied: wte and lm_head own the same parameter
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, clipping_style="layer-wise")
    groups = _names(clipper)
    # wte (= lm_head), wpe, ln_f, and per block ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj
    assert len(groups) == 3 + 2 * 6
    assert {"transformer.wte.weight"} in groups
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"} in groups
    assert sorted(n for g in groups for n in g) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    clipper.remove()
    untied = BookKeepingClipper(gpt2(tied=False), max_grad_norm=1.0, clipping_style="layer-wise")
    assert {"lm_head.weight"} in _names(untied) and len(untied.group_names) == 3 + 2 * 6 + 1
    untied.remove()


class TwoHeads(nn.Module):
    """Two linear layers sharing a weight (different biases): one module-wise group for both."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.c = nn.Linear(3, 2)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_modules_sharing_a_parameter_are_one_group(float64):
    model = TwoHeads()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, clipping_style="layer-wise")
    assert _names(clipper) == [{"a.weight", "a.bias", "b.bias"}, {"c.weight", "c.bias"}]
    clipper.remove()
    torch.manual_seed(0)
    batches = [{"input_ids": torch.randn(5, 4, 3)}, {"input_ids": torch.randn(3, 4, 3)}]

    def loss_fn(m, b):
        return (m(b["input_ids"]) ** 2).sum((1, 2))

    for mode in MODES:
        for fn in FNS:
            check_policy(model, batches, loss_fn, mode=mode, style="layer-wise", fn=fn)


@pytest.mark.parametrize(
    ("style", "error", "match"),
    [
        ([["*wte*"], ["*.h.*"]], ValueError, "in no group.*wpe"),
        ([["*"], ["*.h.0.*"]], ValueError, "in several groups"),
        ([["*"], ["nothing*"]], ValueError, "match no trainable parameter"),
        ("per-layer", ValueError, "Unknown `clipping_style`"),
        ([], TypeError, "non-empty list"),
        (["*wte*"], TypeError, "list of parameter-name patterns"),
    ],
)
def test_bad_groups_are_refused(style, error, match):
    with pytest.raises(error, match=match):
        BookKeepingClipper(gpt2(), max_grad_norm=1.0, clipping_style=style)


def test_bad_policy_arguments_are_refused():
    model = gpt2()
    with pytest.raises(ValueError, match="Unknown `clipping_fn`"):
        BookKeepingClipper(model, max_grad_norm=1.0, clipping_fn="clip")
    with pytest.raises(ValueError, match="`gamma` must be > 0"):
        BookKeepingClipper(model, max_grad_norm=1.0, clipping_fn="automatic", gamma=0.0)
    with pytest.raises(ValueError, match="not supported in `ghost` mode"):
        BookKeepingClipper(model, max_grad_norm=1.0, mode="ghost", clipping_style="layer-wise")
    with pytest.raises(TypeError, match="`grad_sink` must be a callable"):
        BookKeepingClipper(model, max_grad_norm=1.0, grad_sink=3)


def test_groups_follow_requires_grad_changes(float64):
    model, batches, loss_fn = policy_case("gpt2-tied")
    model = copy.deepcopy(model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, clipping_style="layer-wise")
    clipper.backward(loss_fn(model, batches[0]))
    model.transformer.h[0].requires_grad_(False)
    clipper.backward(loss_fn(model, batches[1]))
    assert len(clipper.group_names) == 3 + 6 and clipper.per_group_norms.shape == (9, len(batches[1]["input_ids"]))
    clipper.remove()


class Recorder:
    """A gradient sink that records each call and whether it came from inside the backward pass."""

    def __init__(self, model):
        self.names = {p: n for n, p in model.named_parameters()}
        self.calls: list[tuple[str, torch.Tensor, bool]] = []

    def __call__(self, param, clipped_sum):
        inside = torch._C._current_graph_task_id() != -1
        self.calls.append((self.names[param], clipped_sum.detach().clone(), inside))


@pytest.mark.parametrize("style", ["all-layer", "layer-wise"])
@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
def test_grad_sink_receives_each_clipped_sum_once(float64, mode, style):
    if mode == "ghost" and style != "all-layer":
        pytest.skip("ghost mode clips all-layer only")
    model, batches, loss_fn = policy_case("gpt2-tied")
    model = copy.deepcopy(model)
    sink = Recorder(model)
    probe = BookKeepingClipper(model, max_grad_norm=1.0, clipping_style=style)
    groups = probe.group_names
    probe.remove()
    _, _, c = group_oracle(model, batches[:1], loss_fn, groups, None, "abadi")
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode, clipping_style=style, grad_sink=sink)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    for batch in batches:
        sink.calls.clear()
        loss = loss_fn(model, batch)
        clipper.prepare(loss, loss_scale=1.0)
        loss.sum().backward(retain_graph=mode == "ghost")
        during = len(sink.calls)
        clipper.finish(loss if mode == "ghost" else None)
        assert sorted(name for name, _, _ in sink.calls) == trainable, "once per parameter per micro-batch"
        if style == "layer-wise":  # every group's uses are reached: each is clipped in its last use's hook
            assert during == len(trainable) and all(inside for _, _, inside in sink.calls)
        else:
            assert during == 0 and not any(inside for _, _, inside in sink.calls)
        _, expected, _ = group_oracle(model, [batch], loss_fn, groups, c, "abadi")
        scale = float(torch.sqrt(sum((g**2).sum() for g in expected.values())))
        for name, got, _ in sink.calls:
            assert_rel_close(got, expected[name], 1e-6, name, scale)
    assert all(p.grad is None for p in model.parameters()), "with a sink, p.grad is left alone"
    clipper.remove()


def test_group_waits_for_all_its_uses_and_frees_its_factors(float64):
    """GPT-2's tied wte/lm_head group: lm_head's gradient arrives first, wte's last; the group is clipped only then.
    Every other group is clipped (and its book-kept factors dropped) inside the backward pass."""
    model, batches, loss_fn = policy_case("gpt2-tied")
    model = copy.deepcopy(model)
    order: list[str] = []
    sink = Recorder(model)

    def record(param, clipped_sum):
        order.append(sink.names[param])

    clipper = BookKeepingClipper(model, max_grad_norm=0.1, clipping_style="layer-wise", grad_sink=record)
    loss = loss_fn(model, batches[0])
    clipper.prepare(loss, loss_scale=1.0)
    loss.sum().backward()
    state = clipper._pass
    assert all(state.done) and not state.pieces, "every group clipped and freed inside the backward"
    assert order.index("transformer.wte.weight") > order.index(
        "lm_head.weight" if False else "transformer.h.1.ln_1.weight"
    )
    assert order[-1] in ("transformer.wte.weight", "transformer.wpe.weight")
    clipper.finish()
    clipper.remove()


@pytest.mark.parametrize("style", ["all-layer", "layer-wise"])
def test_loss_scale_given_to_prepare(float64, style):
    """``prepare(loss, loss_scale=w)`` then a backward of ``w * loss.sum()``: clipping at ``w * C_g``, ``w`` times the
    clipped sum; the same without the scale at ``prepare`` (groups clipped in ``finish``)."""
    model, batches, loss_fn = policy_case("gpt2-tied")
    reference, c = check_policy(model, batches[:1], loss_fn, mode="bk", style=style, fn="abadi")
    for at_prepare in (True, False):
        m = copy.deepcopy(model)
        clipper = BookKeepingClipper(m, max_grad_norm=c, mode="bk", clipping_style=style)
        loss = loss_fn(m, batches[0])
        clipper.prepare(loss, loss_scale=8.0 if at_prepare else None)
        (8.0 * loss.sum()).backward()
        clipper.finish(loss_scale=None if at_prepare else 8.0)
        params = dict(m.named_parameters())
        for name, expected in reference.items():
            assert_rel_close(params[name].grad, 8.0 * expected, 1e-6, name, 1.0)
        clipper.remove()
    m = copy.deepcopy(model)
    clipper = BookKeepingClipper(m, max_grad_norm=c, clipping_style=style)
    loss = loss_fn(m, batches[0])
    clipper.prepare(loss, loss_scale=2.0)
    (2.0 * loss.sum()).backward()
    with pytest.raises(ValueError, match="differs from the `loss_scale=2.0`"):
        clipper.finish(loss_scale=4.0)
    clipper.remove()
