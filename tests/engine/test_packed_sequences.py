"""Per-sequence clipping inside packed rows (``BookKeepingClipper(..., packed_sequences=True)``) against the oracle.

The oracle is independent of the packing code: every sequence runs **alone**, unpacked (a batch of one, no
``position_ids``, HF's own positions, :func:`hf_dp.losses.causal_lm_loss`), and plain float64 autograd gives its
gradient; the engine sees the same sequences packed as TRL's padding-free collator packs them (one row of all of
them, or best-fit rows of 12 tokens holding 2-3 sequences each; ``position_ids`` restarting at each sequence, no
attention mask) and must give each sequence's norm and the clipped sum ``sum_s min(1, C / ||g_s||) g_s`` (C the median
norm: some sequences clipped, some not), accumulated over two micro-batches. Every parameter is checked on its own.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers.models import VOCAB, gpt2, gpt2_lora, llama, llama_lora
from helpers.oracle import oracle_per_example
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_outputs import CausalLMOutput

from hf_dp import BookKeepingClipper
from hf_dp.layers import UnsupportedModuleError
from hf_dp.losses import causal_lm_loss
from hf_dp.packed_sequences import packed_causal_lm_loss, packed_sequence_ids

LENGTHS = [7, 5, 6, 4, 2, 9, 3, 8, 5, 3]
#: Micro-batch 1 (sequences 0-6): three best-fit rows of 12 tokens, or all in one row; micro-batch 2: one row.
ROWS = [[0, 1], [2, 3, 4], [5, 6]]
ONE_ROW = [[0, 1, 2, 3, 4, 5, 6]]
SECOND = [[7, 8, 9]]  # 16 tokens in one row: as many tokens as the models' hidden size


def sequences(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


def pack(seqs, rows, *, trl_labels=True):
    """Packed rows as TRL's padding-free collator makes them (labels -100 at each sequence's first token)."""
    ids = torch.stack([torch.cat([seqs[i] for i in row]) for row in rows])
    position_ids = torch.stack([torch.cat([torch.arange(len(seqs[i])) for i in row]) for row in rows])
    labels = ids.clone()
    if trl_labels:
        labels[position_ids == 0] = -100
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def packed_loss(model, batch, use_cache=False):
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=use_cache)
    return packed_causal_lm_loss(out.logits, batch["labels"], batch["position_ids"], reduction="sum")


def alone_loss(model, batch):
    """The oracle's loss: one sequence alone, HF's own positions, the usual shift."""
    return causal_lm_loss(
        model(input_ids=batch["input_ids"], use_cache=False).logits, batch["input_ids"], reduction="sum"
    )


def qwen2():
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def oracle(model, seqs, micro_batches):
    """Per micro-batch the norms of its sequences (each run alone), the clip C (median of the first), and the
    accumulated clipped sums per parameter name."""
    ref = copy.deepcopy(model)
    norms_per_batch, grads_per_batch = [], []
    for rows in micro_batches:
        grads = []
        for i in [i for row in rows for i in row]:
            names, g = oracle_per_example(ref, {"input_ids": seqs[i][None]}, alone_loss)
            grads.append(g[0])
        norms_per_batch.append(torch.stack([torch.sqrt(sum((x**2).sum() for x in gi)) for gi in grads]))
        grads_per_batch.append(grads)
    clip = float(norms_per_batch[0].median())
    total = {n: 0 for n in names}
    for norms, grads in zip(norms_per_batch, grads_per_batch, strict=True):
        coef = (clip / (norms + 1e-6)).clamp(max=1.0)
        for k, n in enumerate(names):
            total[n] = total[n] + sum(coef[i] * grads[i][k] for i in range(len(grads)))
    return norms_per_batch, clip, total


def check_packed(model, mode, layout, *, style="all-layer", seed=1):
    model = model.double()
    seqs = sequences(seed)
    micro_batches = [layout, SECOND]
    norms, clip, expected = oracle(model, seqs, micro_batches)
    assert (norms[0] > clip).any() and (norms[0] < clip).any()
    clipper = BookKeepingClipper(model, max_grad_norm=clip, mode=mode, clipping_style=style, packed_sequences=True)
    try:
        for rows, want in zip(micro_batches, norms, strict=True):
            clipper.backward(packed_loss(model, pack(seqs, rows)))
            assert clipper.per_example_norms.shape == (len(want),)
            if style == "all-layer":
                torch.testing.assert_close(clipper.per_example_norms, want, rtol=1e-7, atol=0)
    finally:
        clipper.remove()
    if style != "all-layer":
        return clipper
    params = dict(model.named_parameters())
    scale = float(torch.sqrt(sum((e**2).sum() for e in expected.values())))
    for name, want in expected.items():
        got = params[name].grad
        assert got is not None, name
        err = float((got - want).norm())
        # 1e-6: Llama's and Qwen2's RMSNorm compute in float32 inside a float64 model (the oracle rounds the same way)
        assert err <= 1e-6 * float(want.norm()) + 1e-12 * scale, f"{name}: {err:.3e} ({mode})"
    return clipper


@pytest.mark.parametrize("layout", [ROWS, ONE_ROW], ids=["bfd-rows", "one-row"])
@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
def test_gpt2_tied_per_sequence(mode, layout):
    torch.manual_seed(0)
    check_packed(gpt2(), mode, layout)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost", "per-sample"])
def test_llama_per_sequence(mode):
    torch.manual_seed(1)
    check_packed(llama(), mode, ROWS)


def test_qwen2_tied_per_sequence():
    torch.manual_seed(2)
    check_packed(qwen2(), "bk-mixopt", ONE_ROW)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_lora_per_sequence(mode):
    """PEFT LoRA: GPT-2's Conv1D targets (fan_in_fan_out) and Llama's q/v projections, LoRA embedding and a
    ``modules_to_save`` head."""
    torch.manual_seed(3)
    model = gpt2_lora()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    check_packed(model, mode, ROWS)
    check_packed(llama_lora(), mode, ONE_ROW, seed=2)


def test_layer_wise_groups_are_per_sequence():
    """Layer-wise clipping (each group clipped inside the backward pass): every group norm of a sequence is the norm
    of its gradient (run alone) restricted to that group."""
    torch.manual_seed(4)
    model = gpt2().double()
    seqs = sequences()
    grads = []
    ref = copy.deepcopy(model)
    for i in [i for row in ROWS for i in row]:
        names, g = oracle_per_example(ref, {"input_ids": seqs[i][None]}, alone_loss)
        grads.append(g[0])
    index = {n: k for k, n in enumerate(names)}
    clipper = BookKeepingClipper(model, max_grad_norm=1e6, clipping_style="layer-wise", packed_sequences=True)
    try:
        loss = packed_loss(model, pack(seqs, ROWS))
        clipper.prepare(loss, loss_scale=1.0)
        loss.sum().backward()
        clipper.finish()
        for g, group in enumerate(clipper.group_names):
            want = torch.stack([sum(gi[index[n]].pow(2).sum() for n in group).sqrt() for gi in grads])
            torch.testing.assert_close(clipper.per_group_norms[g], want, rtol=1e-9, atol=1e-15)
    finally:
        clipper.remove()


def test_gradient_checkpointing_per_sequence():
    torch.manual_seed(5)
    model = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check_packed(model, "bk-mixopt", ROWS)


# ---------------------------------------------------------------------- the self-check: each sequence run alone
@pytest.mark.parametrize("make", [gpt2, llama])
def test_self_check_compares_each_sequence_with_itself_alone(make):
    torch.manual_seed(6)
    model = make().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, packed_sequences=True)
    try:
        assert clipper.self_check(pack(sequences(), ROWS), packed_loss) < 1e-6
        assert all(p.grad is None for p in model.parameters())  # norms only
    finally:
        clipper.remove()


class AbsolutePositions(nn.Module):
    """GPT-2 plus a trainable table of each token's absolute position in its row: the sequences do not attend to
    each other (the engine's gradient check passes), but a packed sequence is not what it is alone."""

    def __init__(self):
        super().__init__()
        self.inner = gpt2()
        self.row_position = nn.Embedding(64, 16)

    def forward(self, input_ids, position_ids=None, use_cache=None):
        where = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        embeds = self.inner.transformer.wte(input_ids) + self.row_position(where)
        return self.inner(inputs_embeds=embeds, position_ids=position_ids, use_cache=use_cache)


def test_self_check_refuses_a_model_that_sees_the_row():
    from hf_dp.engine.self_check import SelfCheckError

    torch.manual_seed(7)
    model = AbsolutePositions().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, packed_sequences=True)
    try:
        with pytest.raises(SelfCheckError, match="loss of sequence .* in its packed row"):
            clipper.self_check(pack(sequences(), ROWS), packed_loss)
    finally:
        clipper.remove()


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("make", [gpt2, llama])
def test_sequences_that_attend_to_each_other_are_refused(make):
    """transformers builds no block-causal mask when the model keeps a cache (its default `use_cache=True`): the
    sequences of a row attend to each other, and the first-batch check refuses before anything reaches p.grad."""
    torch.manual_seed(8)
    model = make().double()
    batch = pack(sequences(), ROWS)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, packed_sequences=True)
    try:
        with pytest.raises(UnsupportedModuleError, match="attend to each other"):
            clipper.backward(packed_loss(model, batch, use_cache=True))
        clipper.abandon()
        assert all(p.grad is None for p in model.parameters())
        clipper.backward(packed_loss(model, batch))  # called as TRL calls it, the same model trains
        assert clipper.per_example_norms.shape == (7,)
    finally:
        clipper.remove()


def test_calls_that_cannot_be_cut_into_sequences_are_refused():
    model = gpt2().double()
    batch = pack(sequences(), ROWS)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, packed_sequences=True)
    try:
        with pytest.raises(UnsupportedModuleError, match="without `position_ids`"):
            model(input_ids=batch["input_ids"], use_cache=False)
        with pytest.raises(UnsupportedModuleError, match="with an `attention_mask`"):
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=torch.ones(3, 12))
        rows_loss = causal_lm_loss(
            model(**{k: batch[k] for k in ("input_ids", "position_ids")}).logits, batch["labels"]
        )
        with pytest.raises(ValueError, match="3 entries but the model's forward pass had 7 sequences"):
            clipper.backward(rows_loss)  # one loss per row, not per sequence
        clipper.abandon()
        with pytest.raises(ValueError, match="`units` with packed sequences"):
            clipper.backward(packed_loss(model, batch), units=[0, 0, 1, 1, 2, 2, 3])
    finally:
        clipper.remove()


class TokenMixer(nn.Module):
    """A causal LM with a module between its embedding and its head (a convolution over the tokens, or a gate)."""

    def __init__(self, module):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = module
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, position_ids=None, use_cache=None):
        h = self.embed(input_ids).transpose(1, 2)
        h = self.mix(h)[..., : input_ids.shape[1]].transpose(1, 2)
        return CausalLMOutput(logits=self.head(h))


class Gate(nn.Module):
    """A module with its own trainable parameter and no closed-form rule (the torch.func fallback)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * torch.sigmoid(self.w)[:, None]


@pytest.mark.parametrize("module", [nn.Conv1d(8, 8, 3, padding=2, groups=8), Gate()], ids=["conv", "fallback"])
def test_layers_that_are_not_token_wise_are_refused_by_name(module):
    torch.manual_seed(9)
    model = TokenMixer(module).double()
    batch = pack(sequences(), ROWS)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, packed_sequences=True)
    try:
        with pytest.raises(UnsupportedModuleError, match=re.escape(f"`mix` ({type(module).__name__}, rule")):
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    finally:
        clipper.remove()
    assert all(p.grad is None for p in model.parameters())


def test_a_frozen_layer_that_mixes_sequences_is_refused():
    """Frozen, a convolution over the tokens still lets one sequence's loss reach its neighbours' tokens."""
    torch.manual_seed(9)
    model = TokenMixer(nn.Conv1d(8, 8, 3, padding=2, groups=8)).double()
    model.mix.requires_grad_(False)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, packed_sequences=True)
    try:
        with pytest.raises(UnsupportedModuleError, match="attend to each other"):
            clipper.backward(packed_loss(model, pack(sequences(), ROWS)))
    finally:
        clipper.remove()
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------- the sequences and their losses
def test_sequence_ids_follow_transformers():
    from transformers.masking_utils import find_packed_sequence_indices

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]])
    ids = packed_sequence_ids(position_ids)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [4, 4, 4, 4, 4, 5, 5, 5]]
    theirs = find_packed_sequence_indices(position_ids)
    for row in range(2):  # the same cuts (transformers numbers the sequences from 0 in each row)
        assert torch.equal(ids[row] - ids[row, 0], theirs[row])


def test_packed_loss_is_each_sequence_alone():
    """No target crosses a boundary (with or without TRL's -100 at each sequence's first token)."""
    torch.manual_seed(10)
    model = gpt2().double()
    seqs = sequences()
    with torch.no_grad():
        alone = torch.cat([alone_loss(model, {"input_ids": seqs[i][None]}) for row in ROWS for i in row])
        for trl_labels in (True, False):
            torch.testing.assert_close(packed_loss(model, pack(seqs, ROWS, trl_labels=trl_labels)), alone)


def test_a_nan_loss_in_a_packed_row_fails_the_loss_comparison():
    """The packed self-check's loss comparison: a sequence's loss of NaN in its packed row against a finite loss alone
    is a failure (every comparison with NaN is false), and so is any other difference past the tolerance; a loss that
    is not finite alone leaves nothing to compare."""
    from hf_dp.engine.packed_check import _compare_losses
    from hf_dp.engine.self_check import SelfCheckError

    _compare_losses(torch.tensor([1.0, 2.0]), [0, 1], [1.0, 2.0], 1e-6)
    _compare_losses(torch.tensor([1.0, float("nan")]), [0, 1], [1.0, float("nan")], 1e-6)
    for packed in ([1.0, float("nan")], [1.0, 2.5]):
        with pytest.raises(SelfCheckError, match="the loss of sequence 1 in its packed row"):
            _compare_losses(torch.tensor(packed), [0, 1], [1.0, 2.0], 1e-6)
