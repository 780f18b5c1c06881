"""Minimal models for the three classes of silently wrong per-example norms found by porting peer suites (issue 17).

1. A tied weight whose other user has no closed-form rule (an ``nn.Embedding`` subclass tied to an ``nn.Linear``).
2. A batch-dimension check fooled by equal sizes (a ``[q, k]`` table used by every example with B == q; a
   batch-second ``[T, B, d]`` layout with T == B).
3. A trainable parameter used outside a hooked module's own forward (a functional call on ``module.weight``; a
   module whose forward reads another module's weight; a rule matched by name whose forward is not the rule's), plus
   the refusals the issue requires to become support: a tuple-returning module, a fallback module as the root.
Each must be exact, or (only where ``refusable`` says so) refused with a clear error; never silently wrong.
"""

from __future__ import annotations

import pytest
import torch
from harness import Case, check_config, peer_params
from probes import floats, ids, layer_case, probe_loss
from torch import nn
from torch.nn import functional as F

V, D = 11, 6


class ScaledEmbedding(nn.Embedding):
    """An ``nn.Embedding`` subclass that multiplies by a scale (BART's ``BartScaledWordEmbedding``)."""

    def __init__(self, num: int, dim: int, scale: float) -> None:
        super().__init__(num, dim)
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale


class TiedLM(nn.Module):
    """Embedding (any flavour) -> tanh -> Linear head whose weight *is* the embedding's weight (no norm: the scale
    matters)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embed = embedding
        self.head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


class FunctionalHeadLM(nn.Module):
    """Tying by a functional call: ``logits = h @ E^T`` with ``E`` the embedding module's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return F.linear(torch.tanh(self.norm(self.embed(x))), self.embed.weight)


class FunctionalReuse(nn.Module):
    """``fc`` is called as a module once, and its weight is used again functionally on other activations."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + F.linear(x.flip(-1), self.fc.weight)


class FunctionalOnly(nn.Module):
    """``proj`` (an ``nn.Linear``) is never called as a module: its parent reads its weight and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return F.linear(torch.tanh(self.inp(x)), self.proj.weight, self.proj.bias)


class SelfReadingLinear(nn.Linear):
    """An ``nn.Linear`` subclass whose forward reads its own weight twice (a weight-normalised projection)."""

    def forward(self, x):
        w = self.weight / self.weight.norm(dim=1, keepdim=True)
        return F.linear(x, w, self.bias)


class OddRMSNorm(nn.Module):
    """Named like an RMSNorm (so a name-based rule matches) but scales by ``w^2``: the rule's formula does not hold."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.3 * torch.randn(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight**2


class RelativeBiasAttention(nn.Module):
    """Self-attention with a ``[q, k]`` bucket table looked up by an ``nn.Embedding`` (T5's relative bias):
    the lookup ids have no batch dimension, the table is used by every example."""

    def __init__(self, buckets: int = 5) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.bias = nn.Embedding(buckets, 1)
        self.buckets = buckets

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        pos = torch.arange(t)
        bucket_ids = (pos[None, :] - pos[:, None]).clamp(-(self.buckets // 2), self.buckets // 2) + self.buckets // 2
        scores = q @ k.transpose(-1, -2) / D**0.5 + self.bias(bucket_ids).squeeze(-1)
        return scores.softmax(-1) @ v


class TransposedLinear(nn.Module):
    """Batch-first input, but the layer runs on ``[T, B, d]`` (a batch-second layout inside the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x.transpose(0, 1))).transpose(0, 1)


class TupleOut(nn.Module):
    """A module with trainable parameters that returns ``(output, aux)``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))
        self.shift = nn.Parameter(torch.randn(D))

    def forward(self, x):
        y = torch.sin(x * self.scale) + self.shift
        return y, y.detach().mean()


class RawRoot(nn.Module):
    """A model that is itself a module with raw parameters and no rule (the fallback's module is the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))
        self.shift = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return torch.sin(x * self.scale) ** 2 + self.shift


class HeadOutside(nn.Module):
    """The loss calls ``model.head`` itself, after ``model(x)`` has returned (a head applied outside the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return torch.tanh(self.body(x))


def _head_outside_loss(model, batch):
    return probe_loss()(lambda x: model.head(model(x)), batch)


def _pair_loss(model, batch):
    """Two forwards of the root per step (siamese / chosen-rejected pairs), then one per-example loss."""
    a, b = model(batch["x"]), model(batch["x"].flip(1))
    return probe_loss()(lambda _: a * b + a, batch)


def _lm_loss(model, batch):
    """Per-example token cross-entropy of predicting the next id (a language-model loss)."""
    x = batch["x"]
    logits = model(x)[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").mean(1)


def _lm(build) -> Case:
    return Case(build=build, batches=ids(V, (4, 5), (3, 5)), loss_fn=_lm_loss)


BATCH_SECOND = "batch-second layout (refusal is acceptable)"

CONFIGS: dict[str, Case] = {
    # class 1: tied weight, the other user has no closed-form rule
    "tied-scaled-embedding-subclass": _lm(lambda: TiedLM(ScaledEmbedding(V, D, scale=D**0.5))),
    "tied-unscaled-embedding-subclass": _lm(lambda: TiedLM(ScaledEmbedding(V, D, scale=1.0))),
    "tied-plain-embedding": _lm(lambda: TiedLM(nn.Embedding(V, D))),
    # class 2: batch dimension fooled by equal sizes
    "qk-table-b-ne-q": layer_case(RelativeBiasAttention, floats((3, 5, D), (2, 5, D))),
    "qk-table-b-eq-q": layer_case(RelativeBiasAttention, floats((5, 5, D), (5, 5, D))),
    "batch-second-linear-t-ne-b": layer_case(
        lambda: nn.Linear(D, D), floats((5, 3, D), (5, 2, D)), batch_dim=1, refusable=BATCH_SECOND
    ),
    "batch-second-linear-t-eq-b": layer_case(
        lambda: nn.Linear(D, D), floats((4, 4, D), (4, 4, D)), batch_dim=1, refusable=BATCH_SECOND
    ),
    "transposed-inside-t-ne-b": layer_case(TransposedLinear, floats((3, 5, D), (2, 5, D)), refusable=BATCH_SECOND),
    "transposed-inside-t-eq-b": layer_case(TransposedLinear, floats((4, 4, D), (4, 4, D)), refusable=BATCH_SECOND),
    # class 3: a trainable parameter used outside a hooked module's own forward
    "functional-tied-lm-head": _lm(FunctionalHeadLM),
    "functional-reuse-of-hooked-weight": layer_case(FunctionalReuse, floats((4, 3, D), (3, 3, D))),
    "functional-only-use-of-linear": layer_case(FunctionalOnly, floats((4, 3, D), (3, 3, D))),
    "subclass-reads-own-weight": layer_case(lambda: SelfReadingLinear(D, D), floats((4, 3, D), (3, 3, D))),
    "rule-by-name-forward-differs": layer_case(lambda: OddRMSNorm(D), floats((4, 3, D), (3, 3, D))),
    # refused today, required by the issue
    "tuple-returning-module": layer_case(TupleOut, floats((4, 3, D), (3, 3, D))),
    "fallback-module-as-root": Case(build=RawRoot, batches=floats((4, 3, D), (3, 3, D)), loss_fn=probe_loss()),
    # uses outside the one root forward the engine book-keeps
    "submodule-called-after-root-forward": Case(
        build=HeadOutside,
        batches=floats((4, 3, D), (3, 3, D)),
        loss_fn=_head_outside_loss,
        refusable="a parameter used after the root forward (in the loss): refused; call the head inside the model",
    ),
    "two-root-forwards-per-step": Case(
        build=lambda: nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)),
        batches=floats((4, 3, D), (3, 3, D)),
        loss_fn=_pair_loss,
    ),
}


@pytest.mark.parametrize(("config_id", "mode"), peer_params(CONFIGS))
def test_silent_class(config_id, mode):
    check_config(config_id, CONFIGS[config_id], mode)


def test_tied_configurations_share_one_tensor():
    """The tied rows really tie: the head's weight is the embedding's (the class-1 trap needs one shared tensor)."""
    model = CONFIGS["tied-scaled-embedding-subclass"].build()
    assert model.head.weight is model.embed.weight
    assert type(model.embed) is not nn.Embedding and isinstance(model.embed, nn.Embedding)
