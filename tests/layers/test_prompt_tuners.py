"""peft's prompt tuning, p-tuning (MLP and LSTM prompt encoders) and CPT, and any module like them: an output computed
once for the whole batch (``[1, ...]``) and copied along it downstream (``repeat``, ``expand``, ``tile``, ...), exact
against the float64 per-example oracle in every mode, or refused naming the module (hf_dp/engine/shared_outputs.py).
"""

import pytest
import torch
from helpers.models import (
    B_EQ_T,
    bert_classifier,
    causal_batches,
    classification_batches,
    gpt2,
    llama,
    seq2seq_batches,
    seq2seq_loss,
    t5,
)
from helpers.oracle import check_clipper
from helpers.trainer import ToyDataset, check_exact_update
from torch import nn

from hf_dp import BookKeepingClipper, UnsupportedModuleError
from hf_dp.losses import causal_lm_loss, sequence_classification_loss

MODES = ["bk", "bk-mixopt", "ghost", "per-sample"]
N = 4  # virtual tokens


def _config(tuner: str, task: str):
    from peft import CPTConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig

    if tuner == "prompt":
        return PromptTuningConfig(task_type=task, num_virtual_tokens=N)
    if tuner == "p-tuning-mlp":
        return PromptEncoderConfig(task_type=task, num_virtual_tokens=N, encoder_hidden_size=8)
    if tuner == "p-tuning-lstm":
        return PromptEncoderConfig(
            task_type=task,
            num_virtual_tokens=N,
            encoder_hidden_size=8,
            encoder_reparameterization_type="LSTM",
            encoder_dropout=0.0,
        )
    if tuner == "prefix":
        return PrefixTuningConfig(task_type=task, num_virtual_tokens=N, prefix_projection=True, encoder_hidden_size=8)
    # token types 1, 2, 3 (mod 4): CPT's gradient mask keeps every virtual token trainable
    return CPTConfig(task_type=task, cpt_token_ids=[3, 4, 5, 6], cpt_mask=[1] * N, cpt_tokens_type_mask=[1, 2, 2, 3])


def _causal_loss(model, batch):
    """The virtual tokens' positions come first in the logits: the loss is on the input tokens' positions."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if logits.shape[1] == batch["labels"].shape[1] + N:
        logits = logits[:, N:]
    return causal_lm_loss(logits, batch["labels"], reduction="sum")


def _classification_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sequence_classification_loss(logits, batch["labels"])


MODELS = {
    "gpt2": (gpt2, "CAUSAL_LM", causal_batches, _causal_loss),
    "llama": (llama, "CAUSAL_LM", causal_batches, _causal_loss),
    "bert": (bert_classifier, "SEQ_CLS", classification_batches, _classification_loss),
    "t5": (t5, "SEQ_2_SEQ_LM", seq2seq_batches, seq2seq_loss),
}
TUNERS = ["prompt", "p-tuning-mlp", "p-tuning-lstm", "cpt", "prefix"]
CASES = [
    (tuner, model)
    for tuner in TUNERS
    for model in MODELS
    # peft builds CPT for causal LMs only, and prefix tuning for models that take past key values (not BERT)
    if not (tuner == "cpt" and MODELS[model][1] != "CAUSAL_LM") and not (tuner == "prefix" and model == "bert")
]


def _peft_model(tuner: str, name: str):
    from peft import get_peft_model

    torch.manual_seed(0)
    build, task, _, _ = MODELS[name]
    model = get_peft_model(build(), _config(tuner, task))
    if tuner == "cpt":  # its delta embedding starts at zero (and is projected to a small norm in each forward)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "delta_embedding" in n:
                    p.normal_(0.0, 0.01)
    model.eval()
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("tuner", "name"), CASES, ids=[f"{t}-{m}" for t, m in CASES])
def test_prompt_learning_is_exact(float64, tuner, name, mode):
    model = _peft_model(tuner, name)
    _, _, batches, loss = MODELS[name]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("prompt_encoder" in n for n in trainable)
    clipper = check_clipper(model, batches(), loss, mode=mode)
    encoder = [m for m in clipper.rules_used if "prompt_encoder" in m]
    assert encoder, clipper.rules_used
    if tuner == "p-tuning-mlp":  # the MLP head by its closed forms, the batch being the copies of the prompt
        assert {clipper.rules_used[m] for m in encoder} == {"EmbeddingRule", "LinearRule"}


@pytest.mark.parametrize("tuner", ["prompt", "p-tuning-mlp", "cpt"])
@pytest.mark.parametrize("shapes", [B_EQ_T, [(6, 2), (6, 2)]], ids=["b-eq-t", "b-eq-t-plus-virtual"])
def test_prompt_learning_with_the_batch_as_long_as_the_sequence(float64, tuner, shapes):
    """Micro-batch == sequence length, or == virtual + real tokens (the length the base model runs on)."""
    model = _peft_model(tuner, "gpt2")
    check_clipper(model, causal_batches(shapes=shapes), _causal_loss, mode="bk-mixopt")


@pytest.mark.parametrize("tuner", ["prompt", "p-tuning-lstm"])
def test_prompt_learning_from_a_batch_of_one(float64, tuner):
    """One example (its gradient is the whole gradient of the prompt), then a batch of several."""
    model = _peft_model(tuner, "llama")
    one = {k: v[:1] for k, v in causal_batches()[0].items()}
    check_clipper(model, [one, causal_batches()[1]], _causal_loss, mode="bk")


def test_seq2seq_prompt_learning_with_the_batch_as_long_as_the_sequence(float64):
    model = _peft_model("p-tuning-mlp", "t5")
    check_clipper(model, seq2seq_batches(shapes=[(5, 5, 5), (5, 1, 5)]), seq2seq_loss, mode="bk")


# ---------------------------------------------------------------------------------------------------------- any module
D = 4


class SharedPrompt(nn.Module):
    """A prompt computed once (``[1, 3, D]`` from ``[1, 3]`` ids, optionally through an MLP) and copied along the batch
    by ``how``, in front of the tokens of each example."""

    def __init__(self, how: str, mlp: bool = False):
        super().__init__()
        self.how = how
        self.prompt = nn.Embedding(3, D)
        self.mlp = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, D)) if mlp else nn.Identity()
        self.tok = nn.Embedding(7, D)
        self.head = nn.Linear(D, 2)

    def copies(self, p: torch.Tensor, rows: int) -> torch.Tensor:
        how = self.how
        if how == "repeat":
            return p.repeat(rows, 1, 1)
        if how == "tile":
            return torch.tile(p, (rows, 1, 1))
        if how == "repeat_interleave":
            return p.repeat_interleave(rows, dim=0)
        if how == "expand_as":
            return p.expand_as(torch.empty(rows, *p.shape[1:]))
        if how == "broadcast_to":
            return torch.broadcast_to(p[0], (rows, *p.shape[1:]))  # a new dimension 0
        if how == "repeat-and-expand":
            return 0.5 * p.repeat(rows, 1, 1) + 0.5 * p.expand(rows, -1, -1)
        if how == "expand":
            return p.expand(rows, -1, -1)
        if how == "leak":  # a path to the loss that is no copy along the batch
            return p.repeat(rows, 1, 1) + p.sum()
        if how == "leak-on-long-inputs":  # that path on some batches only
            return p.repeat(rows, 1, 1) + (p.sum() if self.long else 0.0)
        raise ValueError(how)

    def forward(self, x):
        rows = x.shape[0] * x.shape[1] if x.dim() == 3 else x.shape[0]
        x = x.reshape(rows, x.shape[-1])  # [B, choices, T] -> [B * choices, T]
        self.long = x.shape[1] > 4
        p = self.mlp(self.prompt(torch.arange(3).unsqueeze(0)))
        h = torch.cat([self.copies(p, rows), self.tok(x)], 1)
        return self.head(torch.tanh(h)).sum(1)  # [B * choices, 2]


def _toy_loss(model, batch):
    out = model(batch["x"])
    out = out.reshape(batch["x"].shape[0], -1)
    return (out * torch.linspace(1.0, -0.5, out.shape[1])).sum(1) ** 2


def _toy_batches(*shapes):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randint(0, 7, shape, generator=g)} for shape in shapes]


HOWS = ["repeat", "tile", "repeat_interleave", "expand", "expand_as", "broadcast_to", "repeat-and-expand"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mlp", [False, True], ids=["embedding", "mlp"])
@pytest.mark.parametrize("how", HOWS)
def test_any_output_copied_along_the_batch_is_exact(float64, how, mlp, mode):
    torch.manual_seed(0)
    clipper = check_clipper(SharedPrompt(how, mlp), _toy_batches((4, 5), (3, 3)), _toy_loss, mode=mode)
    assert clipper.rules_used["prompt"] == "EmbeddingRule"


class AddedPositions(nn.Module):
    """A ``[1, T, D]`` position table computed once and added to the batch (HF's position embeddings), or (``copied``)
    first copied along the batch by ``expand``."""

    def __init__(self, copied: bool = False):
        super().__init__()
        self.copied = copied
        self.pos = nn.Embedding(6, D)
        self.tok = nn.Embedding(7, D)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        p = self.pos(torch.arange(x.shape[1]).unsqueeze(0))
        h = self.tok(x) + (p.expand(x.shape[0], -1, -1) if self.copied else p)
        return self.head(torch.tanh(h)).sum(1)


@pytest.mark.parametrize("copied", [False, True], ids=["added", "copied"])
def test_a_table_added_to_the_batch_is_expanded_after_one_run(float64, monkeypatch, copied):
    """The proof expands ``[1, ...]`` outputs first: one run with them expanded, watched for copies of them along the
    batch. A table added to the batch is expanded with no search for copies; one the model copies (by a view,
    ``expand``) is searched for copies and deferred, as before. Exact either way."""
    import hf_dp.engine.proof as proof

    searched, plans = [], []
    real_search, real_prove = proof.copied_calls, proof.PlanProof._prove_expansions
    monkeypatch.setattr(proof, "copied_calls", lambda *a: searched.append(1) or real_search(*a))
    monkeypatch.setattr(
        proof.PlanProof, "_prove_expansions", lambda self, plan, *a: plans.append(plan) or real_prove(self, plan, *a)
    )
    torch.manual_seed(0)
    check_clipper(AddedPositions(copied), _toy_batches((4, 5), (3, 3)), _toy_loss, mode="bk-mixopt")
    assert len(plans) == 1 and len(searched) == int(copied)
    deferred = [layout.deferred for layouts in plans[0].calls.values() for layout in layouts if layout.expand]
    assert deferred == [copied]


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_copies_of_several_rows_per_example(float64, mode):
    """[B, choices, T] run as [B * choices, T] rows: the prompt copied to every row, ``choices`` rows per example."""
    torch.manual_seed(0)
    check_clipper(SharedPrompt("repeat", mlp=True), _toy_batches((3, 2, 3), (2, 2, 4)), _toy_loss, mode=mode)


def test_a_shared_output_that_reaches_the_loss_otherwise_is_refused(float64):
    """``p.repeat(B, 1, 1) + p.sum()``: the second path is no copy along the batch (nor does the model take ``p`` as a
    broadcast), so the examples' shares of the prompt's gradient cannot be proven: refused at the first forward
    pass, naming the modules."""
    torch.manual_seed(0)
    model = SharedPrompt("leak", mlp=True)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=r"\['mlp\.0', 'mlp\.2', 'prompt'\] are the same for every"):
        _toy_loss(model, _toy_batches((4, 5))[0])
    clipper.remove()


@pytest.mark.parametrize("mode", ["bk", "per-sample"])
def test_a_path_that_is_no_copy_on_a_later_batch_is_refused(float64, mode):
    """The plan is proven on a batch where the prompt reaches the loss through its copies alone; a later batch takes
    another path too: the examples' shares no longer add up to the prompt's gradient, and the backward pass raises,
    naming the module, before anything of it reaches ``p.grad``."""
    torch.manual_seed(0)
    model = SharedPrompt("leak-on-long-inputs", mlp=True)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    short, long = _toy_batches((4, 3), (3, 5))
    clipper.backward(_toy_loss(model, short))
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedModuleError, match=r"`mlp\.2` \(Linear\) is computed once for the whole batch"):
        clipper.backward(_toy_loss(model, long))
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
    clipper.remove()


def test_prompt_tuning_through_the_trainer_is_exact(float64, tmp_dir):
    """One SGD step of ``DPTrainer`` (its own causal-LM loss, the self-check on) is the clipped mean of the
    per-example gradients of peft's loss: the virtual tokens' positions labelled -100 (the last one predicts the
    first input token)."""
    model = _peft_model("prompt", "gpt2")
    model.train()

    def loss(model, example):
        ids, mask, labels = (example[k].unsqueeze(0) for k in ("input_ids", "attention_mask", "labels"))
        logits = model(input_ids=ids, attention_mask=mask).logits[:, N - 1 : -1]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        return (ce.sum(1) / (labels != -100).sum(1))[0]

    trainer = check_exact_update(model, ToyDataset(8), loss, tmp_dir, dp_self_check=True)
    assert trainer.loss_type == "causal_lm"
