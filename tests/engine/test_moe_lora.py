"""MoE models whose experts are modules of their own (nllb-moe, Switch, transformers 4.x Mixtral), with LoRA on the
experts, against the float64 per-example oracle (issue 38, item 7).

- **Rows the router orders.** Such a block runs each expert on the token rows routed to it, gathered by an index the
  router computed (``x[top_x]``), ordered by the router's choice first. The probe's comparison of examples ``[0]`` and
  ``[1, 0]`` proved a layout for the experts' linears when every probed token picked the same expert (rows then in
  token order); on a batch whose examples route differently, an example's rows were no longer one block: silently
  wrong norms (or a refusal by the support check). Calls on routed rows now get no layout and the experts container
  covers them through the fallback (``hf_dp.engine.routing``); an expert no probed token picked goes with them.
- **State the probe leaves.** nllb-moe's router keeps the token count of an eval-mode call as its ``expert_capacity``
  for training: after the eval-mode probe on two examples, a training batch of three dropped tokens that each example
  alone keeps (examples coupled, 0.8x to 5x the oracle). The engine now puts every module's attributes back after its
  own runs of the model (``hf_dp.engine.module_state``).
- **Random draws over routed rows.** The experts' token dropout draws one mask over an expert's rows in the router's
  order; the fallback's replay cannot cut it per example: refused, naming the experts container.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn

from hf_dp import BookKeepingClipper
from hf_dp.engine.probe import run_probe
from hf_dp.losses import token_loss

MODES = ["bk", "bk-mixopt", "ghost"]


# ------------------------------------------------------------------------------------------------ a block of experts
class Expert(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class ExpertModules(nn.Module):
    """transformers 4.x Mixtral's sparse block, one module per expert, 2 experts. ``top_k=2``: every token visits
    both experts, and expert ``e`` runs on its first-choice tokens, then its second-choice ones (always all the
    tokens, in an order the router sets). ``top_k=1`` (Switch): an expert runs on its tokens only if some token picked
    it."""

    def __init__(self, d: int, h: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, 2, bias=False)
        self.experts = nn.ModuleList([Expert(d, h), Expert(d, h)])

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.gate(flat).softmax(-1), self.top_k, dim=-1)
        mask = nn.functional.one_hot(chosen, 2).permute(2, 1, 0)  # [expert, slot, token]
        out = torch.zeros_like(flat)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, rows = torch.where(mask[e[0]])
            out.index_add_(0, rows, self.experts[int(e[0])](flat[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class ToyMoE(nn.Module):
    def __init__(self, top_k: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.moe = ExpertModules(4, 6, top_k)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():  # the first expert's logit is 0, the second's 5 x_0: a token picks the second iff x_0 > 0
            self.moe.gate.weight.zero_()
            self.moe.gate.weight[1, 0] = 5.0

    def forward(self, x):
        return self.head(x + self.moe(x)).squeeze(-1).pow(2).sum(-1)


def _toy_loss(model, batch):
    return model(batch["x"])


def _toy_batch(mixed: bool, seed: int) -> dict:
    """3 examples of 4 tokens; every token picks the second expert first, except (``mixed``) tokens 1 and 2 of
    example 2, which pick the first: examples 0 and 1 (the probed ones) route the same in both batches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    x[..., 0] = x[..., 0].abs() + 0.2
    if mixed:
        x[2, 1:3, 0] *= -1
    return {"x": x}


def _toy_lora(top_k: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["up", "down"], init_lora_weights=False)
    return get_peft_model(ToyMoE(top_k), config).double()


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_experts_a_batch_that_routes_otherwise_than_the_probed_examples(float64, mode):
    """The plan is proven on a batch whose tokens all pick the second expert (the experts' rows then in token order);
    the next batch routes two tokens of example 2 to the first expert. Before: that batch's norms and clipped sums
    silently wrong (the rows read as blocks of 4 per example)."""
    check_clipper(_toy_lora(2), [_toy_batch(False, 0), _toy_batch(True, 1)], _toy_loss, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_experts_that_no_probed_example_picks(float64, mode):
    """Switch-style top-1: no token of the probed examples picks the first expert, example 2 does. Its adapters go
    with the experts container's fallback (before: refused, no layout proven for a call no sub-batch makes)."""
    check_clipper(_toy_lora(1), [_toy_batch(True, 0), _toy_batch(True, 1)], _toy_loss, mode=mode)


def test_the_probe_marks_the_calls_on_routed_rows_only(float64):
    """The calls of the expert modules (and of everything inside them) are routed; the block, its gate and the head
    are not."""
    model = _toy_lora(2)
    names = {id(m): n for n, m in model.named_modules()}
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    run = run_probe(model, (_toy_batch(True, 0)["x"],), {}, params)
    routed = {names[id(c.module)] for c in run.calls if c.index in run.routed}
    assert routed and all(".experts." in n for n in routed), routed
    assert any(n.endswith("lora_A.default") for n in routed)
    plain = {names[id(c.module)] for c in run.calls if c.index not in run.routed}
    assert {n for n in plain if n.endswith(("moe", "gate", "head"))} == {
        "base_model.model.moe",
        "base_model.model.moe.gate",
        "base_model.model.head",
    }


# -------------------------------------------------------------------------------------------------------- nllb-moe
def _nllb_moe(seed: int = 0):
    """A tiny NLLB-MoE whose second encoder and decoder layers are sparse (2 experts, top-2, capacity 64), with LoRA on
    every linear (the experts' ``fc1`` and ``fc2`` among them), no dropout (the experts' token dropout draws masks
    of data-dependent shapes, which the fallback's per-example re-run cannot replay: refused)."""
    from peft import LoraConfig, get_peft_model
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    config = NllbMoeConfig(
        vocab_size=99,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_experts=2,
        expert_capacity=64,
        encoder_sparse_step=2,
        decoder_sparse_step=2,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        moe_token_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    torch.manual_seed(seed)
    model = NllbMoeForConditionalGeneration(config).double()
    torch.manual_seed(seed + 1)
    lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, lora).double().train()


def _nllb_loss(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return token_loss(model(**inputs).logits, batch["labels"], reduction="sum")


def _nllb_batch(padded: bool) -> dict:
    """3 examples of 8 source and 5 target tokens (``padded``: the second example's last 3 source tokens padding)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 90, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    if padded:
        mask[1, 5:] = 0
        ids[1, 5:] = 1
    decoder = torch.randint(3, 90, (3, 5), generator=g)
    labels = torch.randint(3, 90, (3, 5), generator=g)
    labels[1, 3:] = -100
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder, "labels": labels}


def _experts(model) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith("ffn.experts")]


def test_nllb_moe_lora_modules_on_the_experts():
    model = _nllb_moe()
    wrapped = [n for n, m in model.named_modules() if n.endswith("experts.expert_0.fc1") and hasattr(m, "lora_A")]
    assert len(wrapped) == 2 and len(_experts(model)) == 2  # one sparse layer in the encoder, one in the decoder


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_nllb_moe_lora_on_experts_is_exact(float64, mode, padded):
    """Padded (the zoo's batch): before, refused (the decoder's probed tokens all picked one expert, so the experts'
    LoRA linears got a layout that the batch's routing breaks); unpadded: before, silently wrong (the probe left the
    routers' capacity at the two-example token count, and the batch of three dropped tokens)."""
    check_clipper(_nllb_moe(), [_nllb_batch(padded)], _nllb_loss, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_nllb_moe_lora_with_frozen_experts_is_exact(float64, mode):
    """LoRA on the attention and the routers, experts frozen: before, silently wrong (the eval-mode probe on two
    examples left the routers' capacity at their token count, so the training batch of three dropped tokens that
    each example alone keeps: the examples coupled)."""
    model = _nllb_moe()
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    check_clipper(model, [_nllb_batch(False), _nllb_batch(False)], _nllb_loss, mode=mode)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_nllb_moe_token_dropout_on_routed_rows_is_refused(float64, mode):
    """The experts' token dropout draws one mask over an expert's rows, in the router's order: the fallback's replay
    cut it along the rows as if they were per example (sizes that matched by chance: 0.38 relative error, silently).
    Now refused, naming the experts container."""
    from hf_dp import UnsupportedModuleError

    model = _nllb_moe()
    for name, m in model.named_modules():
        if name.endswith("ffn.experts"):
            m.moe_token_dropout = m.token_dropout.p = 0.3
    batch = _nllb_batch(False)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    with pytest.raises(UnsupportedModuleError, match=r"`base_model\.model\.model\.\w+\.layers\.1\.ffn\.experts` runs"):
        clipper.backward(_nllb_loss(model, batch))


def test_nllb_moe_routers_keep_their_capacity_through_the_engine(float64):
    """The routers' `expert_capacity` after the engine's first step and its self-check is what the config set
    (before: the token count of the engine's last eval-mode run). The experts are frozen: no routed rows, only the
    state the engine's own runs leave."""
    model = _nllb_moe()
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    routers = [m for n, m in model.named_modules() if n.endswith("ffn.router")]
    assert [r.expert_capacity for r in routers] == [64, 64]
    batch = _nllb_batch(False)
    clipper = BookKeepingClipper(copy.deepcopy(model), max_grad_norm=1.0, mode="bk-mixopt")
    clipper.backward(_nllb_loss(clipper.model, batch))
    clipper.self_check(batch, _nllb_loss)
    engine_routers = [m for n, m in clipper.model.named_modules() if n.endswith("ffn.router")]
    assert [r.expert_capacity for r in engine_routers] == [64, 64]
    clipper.remove()
