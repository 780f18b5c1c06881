"""Layouts the engine proves instead of guessing, and uses it covers wherever they happen (float64 oracle).

Every case has micro-batch == sequence length somewhere, so that no check can tell the batch by its size.
"""

import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn
from torch.nn import functional as F

from hf_dp import BookKeepingClipper, UnsupportedModuleError

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]
D = 4


def project(y: torch.Tensor) -> torch.Tensor:
    """A per-example loss whose output gradient differs between examples and positions."""
    g = torch.Generator().manual_seed(1)
    r = torch.randn(y.shape[1:], generator=g, dtype=y.dtype)
    return (y * r).flatten(1).sum(1) + 0.5 * (y**2).flatten(1).sum(1)


class Flattened(nn.Module):
    """OPT-style: hidden states reshaped to [B*T, d] before the feed-forward layers (k = T rows per example)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 6)
        self.fc2 = nn.Linear(6, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        b, t, d = x.shape
        h = self.fc2(torch.relu(self.fc1(x.reshape(-1, d))))
        return self.norm(h.view(b, t, d) + x)


class Transposed(nn.Module):
    """Batch-first inputs, but the layer runs on [T, B, d] inside."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x.transpose(0, 1))).transpose(0, 1)


class RelativeBias(nn.Module):
    """T5-style: a bias table looked up with [q, k] bucket ids (no batch dimension), added to the batch's scores."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.bias = nn.Embedding(5, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        pos = torch.arange(x.shape[1])
        buckets = (pos[None, :] - pos[:, None]).clamp(-2, 2) + 2
        scores = q @ k.transpose(-1, -2) + self.bias(buckets).squeeze(-1)
        return scores.softmax(-1) @ v


class Model(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _run(model, shape, mode, seed=0):
    torch.manual_seed(seed)
    batches = [{"x": torch.randn(*shape)}, {"x": torch.randn(*shape)}]
    return check_clipper(model, batches, lambda m, b: project(m(b["x"])), mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(3, 5, D), (5, 5, D)])
def test_flattened_rows_per_example(float64, mode, shape):
    clipper = _run(Model(Flattened()), shape, mode)
    assert clipper.rules_used["inner.fc1"] == "LinearRule"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(3, 5, D), (4, 4, D)])
def test_batch_second_inside_the_model(float64, mode, shape):
    clipper = _run(Model(Transposed()), shape, mode)
    assert clipper.rules_used["inner.fc"] == "LinearRule"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(3, 5, D), (5, 5, D)])
def test_table_without_batch_dimension_is_covered_by_its_parent(float64, mode, shape):
    clipper = _run(Model(RelativeBias()), shape, mode)
    assert clipper.rules_used["inner"] == "FallbackRule"  # the smallest module whose outputs carry the examples
    assert clipper.rules_used["inner.qkv"] == "LinearRule"


class Raw(nn.Module):
    """Raw parameters and no rule, used as the root model itself."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))
        self.shift = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return torch.sin(x * self.scale) ** 2 + self.shift


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x, *, offset=0.0):
        y = torch.sin(x * self.scale) + offset
        return y, None, y.detach().mean()


class UsesTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.inner = TupleOut()

    def forward(self, x):
        y, _, _ = self.inner(self.fc(x), offset=0.5)
        return y


class Attention(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)
        self.batch_first = batch_first

    def forward(self, x):
        if not self.batch_first:
            x = x.transpose(0, 1)
        out, _ = self.attn(x, x, x)
        return out if self.batch_first else out.transpose(0, 1)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(D, 3, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("root", Raw),
        ("tuple-output", UsesTuple),
        ("multihead-attention", lambda: Attention(True)),
        ("multihead-attention-batch-second", lambda: Attention(False)),
        ("gru", Recurrent),
    ],
)
def test_fallback_takes_any_module(float64, mode, name, build):
    clipper = _run(build(), (4, 4, D), mode)
    assert "FallbackRule" in clipper.rules_used.values()


class FunctionalReuse(nn.Module):
    """``fc`` is called as a module, and its weight is used again by a functional call in the parent."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + F.linear(x.flip(-1), self.fc.weight)


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.5


class TiedScaled(nn.Module):
    """A scaled embedding subclass (BART's) whose weight is tied to an ``nn.Linear`` head."""

    def __init__(self):
        super().__init__()
        self.embed = ScaledEmbedding(7, D)
        self.head = nn.Linear(D, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


class OddRMSNorm(nn.Module):
    """Named like an RMSNorm (the name-based rule matches) but scales by ``w ** 2``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(D))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight**2


class FunctionalReuseTwo(nn.Module):
    """Two hooked modules whose weights the parent also reads functionally: the parent's fallback covers both,
    and neither module counts its own use while the parent runs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        h = self.norm(torch.tanh(self.fc(x)))
        return h + F.linear(x, self.fc.weight) * F.layer_norm(x, (D,), self.norm.weight)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build", [FunctionalReuse, FunctionalReuseTwo])
def test_functional_use_of_a_hooked_weight(float64, mode, build):
    clipper = _run(Model(build()), (4, 4, D), mode)
    assert clipper.rules_used["inner"] == "FallbackRule"


@pytest.mark.parametrize("mode", MODES)
def test_scaled_embedding_tied_to_a_linear_head(float64, mode):
    torch.manual_seed(0)
    ids = [{"x": torch.randint(0, 7, (4, 4))}, {"x": torch.randint(0, 7, (3, 4))}]
    clipper = check_clipper(TiedScaled(), ids, lambda m, b: project(m(b["x"])), mode=mode)
    assert clipper.rules_used["embed"] == "ScaledRule" and clipper.rules_used["head"] == "LinearRule"


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_guessed_rule_that_does_not_hold_goes_to_the_fallback(float64, mode):
    clipper = _run(Model(OddRMSNorm()), (4, 4, D), mode)
    assert clipper.rules_used["inner"] == "FallbackRule"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mean", ["sum", "mean", "max"])
def test_embedding_bag_with_offsets(float64, mode, mean):
    """Bags cut by offsets (one per example, one of them empty), as the root model."""
    torch.manual_seed(0)

    def bags(sizes, weights):
        flat = torch.randint(0, 9, (sum(sizes),))
        offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0)[:-1].tolist()])
        batch = {"input": flat, "offsets": offsets}
        if weights:
            batch["per_sample_weights"] = torch.rand(sum(sizes)) + 0.5
        return batch

    weights = mean == "sum"
    batches = [bags([3, 1, 4, 0], weights), bags([2, 2, 2, 2], weights)]  # the second: ids == bags == 8 / 4 * 4
    bag = nn.EmbeddingBag(9, D, mode=mean, padding_idx=0)
    clipper = check_clipper(bag, batches, lambda m, b: project(m(**b)), mode=mode)
    assert clipper.rules_used[""] == "EmbeddingBagRule"


@pytest.mark.parametrize("mode", MODES)
def test_two_forward_passes_before_one_loss(float64, mode):
    """Pairs of inputs through the same model (siamese, chosen/rejected): both passes are book-kept."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))

    def pair_loss(m, b):
        a, c = m(b["x"]), m(b["x"].flip(1))
        return project(a * c + a)

    check_clipper(model, [{"x": torch.randn(4, 4, D)}, {"x": torch.randn(3, 4, D)}], pair_loss, mode=mode)


class Noisy(nn.Module):
    """Raw parameters (the fallback) and dropout inside the same module."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D) + 0.1 * torch.randn(D))
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.sin(x * self.scale))


def _same_forward_oracle(model, batch, loss_fn):
    """Per-example norms by autograd on the very forward pass the engine book-keeps (same dropout masks): ghost mode
    keeps the parameters in the graph, so each loss can be differentiated before the engine's backward."""
    clipper = BookKeepingClipper(model.train(), max_grad_norm=1e9, mode="ghost")
    loss = loss_fn(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = []
    for i in range(loss.shape[0]):
        grads = torch.autograd.grad(loss[i], params, retain_graph=True, allow_unused=True)
        expected.append(torch.sqrt(sum((g**2).sum() for g in grads if g is not None)))
    clipper.backward(loss)
    rules = dict(clipper.hooked_modules)
    clipper.remove()
    return clipper.per_example_norms, torch.stack(expected), rules


def test_dropout_inside_a_fallback_is_replayed(float64):
    torch.manual_seed(0)
    got, expected, rules = _same_forward_oracle(
        Model(Noisy()), {"x": torch.randn(4, 4, D)}, lambda m, b: project(m(b["x"]))
    )
    assert rules["inner"] == "FallbackRule"
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=0)
    # the one-backward modes draw the same masks from the same seed, and agree with ghost mode
    x = torch.randn(4, 4, D)
    results = []
    for mode in MODES:
        torch.manual_seed(1)
        model = Model(Noisy()).train()
        clipper = BookKeepingClipper(model, max_grad_norm=0.5, mode=mode)
        clipper.backward(project(model(x)))
        results.append((clipper.per_example_norms, model.inner.scale.grad))
        clipper.remove()
    for norms, grad in results[1:]:
        torch.testing.assert_close(norms, results[0][0], rtol=1e-9, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-9, atol=1e-15)


def test_random_draws_that_cannot_be_replayed_are_refused():
    class Alpha(Noisy):
        def forward(self, x):
            return F.alpha_dropout(x * self.scale, 0.2, training=self.training)

    model = Model(Alpha()).train()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="cannot replay"):
        model(torch.randn(3, 2, D))
    clipper.remove()


@pytest.mark.parametrize("name", ["t5", "beit"])
def test_models_with_dropout_in_fallback_modules(float64, name):
    """T5's attention dropout (around its relative bias) and BEiT's stochastic depth and attention dropout (around
    its layer scales) run inside modules the fallback re-runs: their masks are replayed per example."""
    from helpers.models import beit, image_batches, image_loss, seq2seq_batches, seq2seq_loss, t5

    torch.manual_seed(0)
    model, batch, loss_fn = {
        "t5": (lambda: t5(dropout=0.2), lambda: seq2seq_batches()[0], seq2seq_loss),
        "beit": (lambda: beit(dropout=0.2), lambda: image_batches()[0], image_loss),
    }[name]
    got, expected, rules = _same_forward_oracle(model().double(), batch(), loss_fn)
    assert "FallbackRule" in rules.values()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


class AutocastInside(nn.Module):
    """Enters bfloat16 autocast inside its forward, as accelerate's wrapper does (after the engine's pre-hook)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.raw = Raw()

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.raw(self.fc(x)).float()


def test_rules_and_fallback_rerun_in_the_forward_autocast_precision():
    torch.manual_seed(0)
    model = AutocastInside()
    batch = {"x": torch.randn(4, 3, D)}
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    assert clipper.self_check(batch, lambda m, b: project(m(b["x"]))) < 5e-2
    clipper.backward(project(model(batch["x"])))
    assert dict(clipper.hooked_modules)["raw"] == "FallbackRule"
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    clipper.remove()


class MultipleChoice(nn.Module):
    """[B, choices, T] ids flattened to [B * choices, T]; position embeddings looked up with [1, T] ids."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(7, D)
        self.pos = nn.Embedding(6, D)
        self.score = nn.Linear(D, 1)

    def forward(self, x):
        b, c, t = x.shape
        h = self.tok(x.reshape(b * c, t)) + self.pos(torch.arange(t).unsqueeze(0))
        return self.score(torch.tanh(h)).reshape(b, c, t)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_over_several_rows_per_example(float64, mode):
    torch.manual_seed(0)
    batches = [{"x": torch.randint(0, 7, (3, 2, 3))}, {"x": torch.randint(0, 7, (2, 2, 3))}]  # B == T; B == choices
    clipper = check_clipper(MultipleChoice(), batches, lambda m, b: project(m(b["x"])), mode=mode)
    assert clipper.rules_used["pos"] == "EmbeddingRule"
