"""peft's LyCORIS adapters LoHa and LoKr (issue 38, item 3): exact against the float64 per-example oracle in every
clipping mode, with and without ``module_dropout`` and ``rank_dropout``.

peft draws ``torch.rand(1)`` for every adapter in every training forward, even with ``module_dropout=0`` (the whole
batch keeps the adapter if the draw exceeds ``module_dropout``), and, with ``rank_dropout``, a mask over the rows of
the delta weight. On ``nn.Linear`` the closed-form rules (``hf_dp/layers/loha.py``, ``lokr.py``) read the draws the
engine recorded in the forward pass; on convolutions (and without those rules) the torch.func fallback re-runs the
adapter per example and replays the draws, each example seeing what the forward drew. Before issue 38 every training
forward was refused ("draws different random numbers than its forward pass").
"""

import pytest
import torch
from helpers.models import (
    bert_classifier as bert,
)
from helpers.models import (
    causal_batches,
    causal_loss,
    classification_batches,
    classification_loss,
    llama,
    seq2seq_batches,
    seq2seq_loss,
    t5,
)
from helpers.oracle import check_clipper
from helpers.random_oracle import check_clipper_seeded
from peft import LoHaConfig, LoKrConfig, get_peft_model
from torch import nn
from torch.overrides import TorchFunctionMode

from hf_dp.layers import RULES

MODES = ["bk", "bk-mixopt", "ghost", "per-sample"]
RULE = {"loha": "LoHaLinearRule", "lokr": "LoKrLinearRule"}
MODELS = {
    "llama": (llama, causal_batches, causal_loss, ["q_proj", "v_proj", "down_proj"]),
    "bert": (bert, classification_batches, classification_loss, ["query", "value", "dense"]),
    "t5": (t5, seq2seq_batches, seq2seq_loss, ["q", "v", "wi"]),
}


def _config(kind, targets, **kw):
    config = LoHaConfig if kind == "loha" else LoKrConfig
    # random initialisation: peft starts one factor at zero, which would leave the others' gradients zero
    return config(r=2, alpha=4, target_modules=targets, init_weights=False, **kw)


def _model(kind, name, **kw):
    factory, batches, loss, targets = MODELS[name]
    return get_peft_model(factory(), _config(kind, targets, **kw)), batches(), loss


class Draws(TorchFunctionMode):
    """Sees every ``torch.rand(1)`` (peft's module-dropout draw); ``value`` replaces what it returns."""

    def __init__(self, value=None):
        super().__init__()
        self.seen, self.value = [], value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.rand and tuple(out.shape) == (1,):
            out = out if self.value is None else torch.full_like(out, self.value)
            self.seen.append(float(out))
        return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_is_exact(float64, kind, mode):
    torch.manual_seed(0)
    model, batches, loss = _model(kind, "llama")
    clipper = check_clipper(model, batches, loss, mode=mode)
    assert RULE[kind] in clipper.rules_used.values()


@pytest.mark.parametrize("name", ["bert", "t5"])
@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_on_encoders_is_exact(float64, kind, name):
    torch.manual_seed(0)
    model, batches, loss = _model(kind, name)
    clipper = check_clipper(model, batches, loss, mode="bk-mixopt")
    assert RULE[kind] in clipper.rules_used.values()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_module_and_rank_dropout_are_read(float64, kind, mode):
    """The module-dropout draw keeps or drops an adapter for the whole batch (both happen here), the rank-dropout
    mask scales its rows: per-example gradients of what each call computed."""
    torch.manual_seed(0)
    model, batches, loss = _model(kind, "llama", module_dropout=0.5, rank_dropout=0.3)
    with Draws() as draws:
        clipper = check_clipper_seeded(model, batches, loss, mode=mode, masked_dropout=False)
    assert RULE[kind] in clipper.rules_used.values()
    assert any(v > 0.5 for v in draws.seen) and any(v <= 0.5 for v in draws.seen), "both outcomes must be tested"


def test_lokr_decomposed_factors_and_rank_dropout_scale(float64):
    """``decompose_both`` (W1 = w1_a @ w1_b) and a factored W2 (rank 1), ``rank_dropout_scale``, on T5."""
    torch.manual_seed(0)
    _, batches, loss, targets = MODELS["t5"]
    config = LoKrConfig(
        r=1,
        alpha=2,
        target_modules=targets,
        init_weights=False,
        decompose_both=True,
        module_dropout=0.3,
        rank_dropout=0.3,
        rank_dropout_scale=True,
    )
    model = get_peft_model(t5(), config)
    names = {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad}
    assert {"lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"} <= names
    clipper = check_clipper_seeded(model, batches(), loss, mode="bk-mixopt", masked_dropout=False)
    assert RULE["lokr"] in clipper.rules_used.values()


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_draw_of_zero_drops_the_adapter_with_module_dropout_zero(float64, kind):
    """peft keeps the adapter if ``torch.rand(1) > module_dropout``: a draw of exactly 0 (probability 2^-24 in
    float32, so it happens in long runs) drops it with ``module_dropout=0``; its gradient is then zero, not a guess."""
    torch.manual_seed(0)
    model, batches, loss = _model(kind, "llama")
    model.base_model.model.lm_head.requires_grad_(True)  # something to learn with every adapter dropped
    with Draws(value=0.0) as draws:
        clipper = check_clipper_seeded(model, batches[:1], loss, mode="bk", masked_dropout=False)
    assert draws.seen and RULE[kind] in clipper.rules_used.values()
    adapters = [p for n, p in model.named_parameters() if p.requires_grad and ("hada_" in n or "lokr_" in n)]
    assert adapters and all(p.grad is not None and not p.grad.any() for p in adapters)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_the_fallback_replays_the_draws_when_no_rule_covers_the_adapter(float64, kind, monkeypatch):
    """Without the closed-form rules the fallback re-runs the adapter per example: the one draw of the call (module
    dropout) and its rank-dropout mask are handed whole to every example's re-run, and training's random stream
    after the backward pass is where the forward left it (checked by ``check_clipper_seeded``)."""
    for cls in [c for c in RULES if c.__module__.startswith(f"peft.tuners.{kind}.")]:
        monkeypatch.delitem(RULES, cls)
    torch.manual_seed(0)
    model, batches, loss = _model(kind, "llama", module_dropout=0.5, rank_dropout=0.3)
    clipper = check_clipper_seeded(model, batches, loss, mode="bk-mixopt", masked_dropout=False)
    assert set(clipper.rules_used.values()) == {"FallbackRule"}


class TinyConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, pixels):
        return self.head(torch.tanh(self.conv(pixels)).mean((2, 3)))


def _conv_loss(model, batch):
    return (model(batch["pixels"]) ** 2).sum(1)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_on_a_convolution_goes_to_the_fallback_exactly(float64, kind, mode):
    torch.manual_seed(0)
    config = _config(kind, ["conv"], module_dropout=0.5, rank_dropout=0.3, use_effective_conv2d=True)
    model = get_peft_model(TinyConv(), config)
    model.base_model.model.head.requires_grad_(True)  # something to learn when the adapter is dropped
    batches = [{"pixels": torch.randn(4, 3, 5, 5)}, {"pixels": torch.randn(3, 3, 5, 5)}]
    clipper = check_clipper_seeded(model, batches, _conv_loss, mode=mode, masked_dropout=False)
    assert clipper.rules_used["base_model.model.conv"] == "FallbackRule"


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_draws_under_activation_checkpointing(float64, kind):
    """Non-reentrant checkpointing recomputes each layer in the backward pass (torch restores the random state, so
    the recomputation draws what the forward drew); the rule reads the draws recorded in the recomputation."""
    torch.manual_seed(0)
    model, batches, loss = _model(kind, "llama", module_dropout=0.5, rank_dropout=0.3)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    clipper = check_clipper_seeded(model, batches, loss, mode="bk-mixopt", masked_dropout=False)
    assert RULE[kind] in clipper.rules_used.values()
