"""Every refusal names the module's path in the model, with its class in parentheses where the refusal is about one
module (issue 38, item 4). A refusal raised by a rule or by the torch.func fallback's re-run knows the module only; the
engine adds its path (``hf_dp.layers.base.named_refusal``). Before issue 38 these said `Linear` or `Odd` only.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.models import causal_batches, causal_loss, llama
from peft import LoHaConfig, get_peft_model
from torch import nn

from hf_dp import BookKeepingClipper
from hf_dp.layers import UnsupportedModuleError

D = 3


class Odd(nn.Module):
    """A module with no closed-form rule (the fallback covers it) whose forward ``draw`` decides."""

    def __init__(self, draw):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D) * 1.5)
        self.register_buffer("calls", torch.zeros(()))
        self.draw = draw

    def forward(self, x):
        return self.draw(self, x * self.scale)


class Model(nn.Module):
    def __init__(self, odd):
        super().__init__()
        self.block = nn.ModuleDict({"odd": odd})
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        return self.head(self.block["odd"](x))


def _refusal(draw) -> str:
    torch.manual_seed(0)
    model = Model(Odd(draw)).train()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk")
    try:
        with pytest.raises(UnsupportedModuleError) as err:
            clipper.backward((model(torch.randn(4, 2, D)) ** 2).sum((1, 2)))
    finally:
        clipper.remove()
    return str(err.value)


def _uncuttable(module, x):
    """A draw of ``B + 1`` numbers: the re-run of one example draws 2, which are no rows of the forward's ``B + 1``
    (unused here, so that the proof of layouts passes: hf_dp refuses what it cannot replay, used or not)."""
    torch.rand(x.shape[0] + 1)
    return x


def _count_calls(module, x):
    module.calls += 1  # a buffer the re-run would change again
    return x


def _alpha_dropout(module, x):
    return F.alpha_dropout(x, 0.2, training=True)


@pytest.mark.parametrize(
    "draw, says",
    [
        (_uncuttable, "draws different random numbers"),
        (_count_calls, "changed its buffers"),
    ],
    ids=["replay-mismatch", "buffers"],
)
def test_a_refusal_of_the_fallbacks_re_run_names_the_path_and_the_class(draw, says):
    message = _refusal(draw)
    assert says in message
    assert "`block.odd` (Odd)" in message


def test_a_draw_that_cannot_be_replayed_names_the_path():
    """Refused in the forward pass, inside the module's own code: the recorder knows which call it records."""
    assert "inside `block.odd`" in _refusal(_alpha_dropout)


def test_a_lycoris_draw_hf_dp_does_not_read_names_the_path(float64):
    """A LoHa forward that draws more than peft's ``torch.rand(1)`` (another peft version): refused, named."""
    torch.manual_seed(0)
    config = LoHaConfig(r=2, alpha=4, target_modules=["q_proj"], init_weights=False)
    model = get_peft_model(llama(), config).double().train()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    original = layer.forward

    def forward(x, *args, **kwargs):
        torch.rand(2)  # a draw peft 0.21's LyCORIS forward does not make
        return original(x, *args, **kwargs)

    layer.forward = forward
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk-mixopt")
    try:
        with pytest.raises(UnsupportedModuleError) as err:
            clipper.backward(causal_loss(model, causal_batches()[0]))
    finally:
        clipper.remove()
    assert "`base_model.model.model.layers.0.self_attn.q_proj` (Linear)" in str(err.value)
    assert "drew [(2,), (1,)]" in str(err.value)
