"""Canaries, their losses under a model, and exposure."""

import math

import numpy as np
import pytest
import torch
from helpers.models import VOCAB, bert_classifier, gpt2, roberta_mlm
from transformers import TrainerControl, TrainerState, TrainingArguments

from hf_dp.audit import (
    CanaryAudit,
    CausalLMCanaries,
    ClassificationCanaries,
    MaskedLMCanaries,
    canary_exposures,
    canary_losses,
    exposure,
)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "<s>", "my", "code", "is", "one", "two", "three"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="<s>")


class TestCanaries:
    def test_causal_items(self):
        canaries = CausalLMCanaries(50, range(3, VOCAB), 6, prefix_ids=[1, 2], seed=0)
        assert len(canaries) == 50
        item = canaries[7]
        assert item["input_ids"].tolist()[:2] == [1, 2] and item["labels"].tolist()[:2] == [-100, -100]
        assert item["labels"][2:].tolist() == item["input_ids"][2:].tolist() == canaries.secret(7).tolist()
        assert item["attention_mask"].tolist() == [1] * 8
        assert set(canaries.secrets.ravel().tolist()) <= set(range(3, VOCAB))
        assert len({tuple(s) for s in canaries.secrets}) == 50

    def test_seeds(self):
        a, b, c = (CausalLMCanaries(20, 30, 5, seed=s).secrets for s in (0, 0, 1))
        assert (a == b).all() and not (a == c).all()
        # The inclusion bits come from another stream than the secrets of the same seed.
        bits = CanaryAudit(CausalLMCanaries(200, 2, 1, seed=4), seed=4).included
        assert not (bits == (CausalLMCanaries(200, 2, 1, seed=4).secrets[:, 0] == 1)).all()
        assert 60 < bits.sum() < 140

    def test_template(self):
        tokenizer = word_tokenizer()
        canaries = CausalLMCanaries.from_template(
            tokenizer, "my code is {secret}", 10, secret_length=3, token_ids=[6, 7, 8], seed=0
        )
        item = canaries[0]
        assert item["input_ids"][:4].tolist() == [2, 3, 4, 5]  # <s> my code is
        assert item["labels"][:4].tolist() == [-100] * 4
        assert set(item["labels"][4:].tolist()) <= {6, 7, 8}
        with pytest.raises(ValueError, match="must end with"):
            CausalLMCanaries.from_template(tokenizer, "{secret} is my code", 10, secret_length=3)

    def test_masked_items(self):
        canaries = MaskedLMCanaries(
            30, range(3, VOCAB), key_length=4, secret_length=2, mask_token_id=2, prefix_ids=[0], suffix_ids=[1], seed=0
        )
        item = canaries[3]
        ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
        assert ids[0] == 0 and ids[-1] == 1 and ids[5:7] == [2, 2]
        assert ids[1:5] == canaries.keys[3].tolist()
        assert labels[5:7] == canaries.secret(3).tolist()
        assert labels[:5] == [-100] * 5 and labels[7:] == [-100]

    def test_classification_items(self):
        true = np.arange(40) % 3
        inputs = [[5, 6, 7][: 1 + i % 3] for i in range(40)]
        canaries = ClassificationCanaries(40, 3, inputs=inputs, true_labels=true, seed=0)
        labels = np.array([int(canaries[i]["labels"]) for i in range(40)])
        assert (labels != true).all() and set(labels.tolist()) == {0, 1, 2}
        assert canaries[4]["input_ids"].tolist() == [5, 6]
        random_inputs = ClassificationCanaries(10, 2, token_ids=range(3, VOCAB), length=5, prefix_ids=[1], seed=0)
        assert random_inputs[0]["input_ids"].shape == (6,) and random_inputs[0]["labels"].dim() == 0
        with pytest.raises(ValueError, match="inputs"):
            ClassificationCanaries(10, 2)
        with pytest.raises(ValueError, match="true_labels"):
            ClassificationCanaries(3, 2, inputs=inputs, true_labels=[0, 1, 2])


def manual_loss(model, item, task):
    """One unpadded item at a time, log-softmax and gather: independent of the batching and padding."""
    inputs = {k: v[None] for k, v in item.items() if k != "labels"}
    logp = torch.log_softmax(model(**inputs).logits[0].double(), -1)
    labels = item["labels"]
    if task == "sequence_classification":
        return -float(logp[int(labels)])
    if task == "causal_lm":
        logp, labels = logp[:-1], labels[1:]
    keep = labels != -100
    return -float(logp[keep].gather(1, labels[keep][:, None]).sum())


class TestLosses:
    @pytest.mark.parametrize(
        "make_model,canaries",
        [
            (gpt2, CausalLMCanaries(9, range(3, VOCAB), 5, prefix_ids=[1], seed=0)),
            (
                roberta_mlm,
                MaskedLMCanaries(
                    9, range(3, VOCAB), key_length=3, secret_length=2, mask_token_id=2, pad_token_id=1, seed=0
                ),
            ),
            (bert_classifier, ClassificationCanaries(9, 3, inputs=[[4, 5, 6, 7][: 1 + i % 4] for i in range(9)])),
        ],
    )
    def test_batched_losses_match_one_at_a_time(self, make_model, canaries):
        torch.manual_seed(0)
        model = make_model()
        model.train()
        items = [canaries[i] for i in range(len(canaries))]
        losses = canary_losses(model, items, task=canaries.task, pad_token_id=canaries.pad_token_id, batch_size=4)
        assert model.training  # mode restored
        assert all(p.grad is None for p in model.parameters())
        model.eval()
        with torch.no_grad():
            expected = [manual_loss(model, item, canaries.task) for item in items]
        np.testing.assert_allclose(losses, expected, rtol=1e-5)

    def test_unknown_task_raises(self):
        with pytest.raises(ValueError, match="causal_lm"):
            canary_losses(gpt2(), [], task="regression")


class PreferTwo(torch.nn.Module):
    """A 'language model' whose loss counts tokens that are not 2: loss(secret) is known without training."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None, **kwargs):
        logits = torch.zeros(*input_ids.shape, 4)
        logits[..., 2] = 5.0
        return {"logits": logits}


class TestExposure:
    def test_rank_formula(self):
        assert exposure(0.5, [1.0, 2.0, 3.0]) == 2.0  # rank 1 of 4
        assert exposure(9.0, [1.0, 2.0, 3.0]) == 0.0  # rank 4 of 4
        assert exposure(2.0, [1.0, 2.0, 3.0]) == pytest.approx(2 - math.log2(3))  # the tie ranks ahead

    @pytest.mark.parametrize("kind", ["causal", "masked"])
    def test_known_losses(self, kind):
        if kind == "causal":
            canaries = CausalLMCanaries(3, [2, 3], 6, prefix_ids=[0], seed=0)
        else:
            canaries = MaskedLMCanaries(3, [2, 3], key_length=2, secret_length=6, mask_token_id=1, seed=0)
        canaries.secrets[0], canaries.secrets[1], canaries.secrets[2] = [2] * 6, [3] * 6, [2, 3, 2, 3, 2, 3]
        exp = canary_exposures(PreferTwo(), canaries, num_alternatives=200, seed=0)
        assert exp[1] == 0.0  # every alternative has a loss <= the all-3 secret
        # The all-2 secret ties only with the ~200/64 alternatives equal to it: exposure near log2(201 / 4).
        assert exp[0] > 4.5
        assert 0 < exp[2] < exp[0]

    def test_classification_has_no_exposure(self):
        canaries = ClassificationCanaries(3, 2, inputs=[[4], [5], [6]])
        with pytest.raises(TypeError, match="generative"):
            canary_exposures(PreferTwo(), canaries)
        with pytest.raises(ValueError, match="num_alternatives=0"):
            CanaryAudit(canaries, num_alternatives=10)


class TestCallback:
    def test_scores_in_eval_mode_and_restores_train_mode(self):
        torch.manual_seed(0)
        model = gpt2()
        model.train()
        seen = []
        model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
        canaries = CausalLMCanaries(8, range(3, VOCAB), 4, prefix_ids=[1], seed=0)
        audit = CanaryAudit(canaries, seed=0, num_alternatives=5)
        callback = audit.callback()
        args, state, control = (
            TrainingArguments(output_dir="unused", report_to="none"),
            TrainerState(),
            TrainerControl(),
        )
        callback.on_train_begin(args, state, control, model=model)
        assert seen and not any(seen) and model.training
        with torch.no_grad():
            model.transformer.wte.weight.mul_(3.0)  # "training"
        callback.on_train_end(args, state, control, model=model)
        assert model.training and all(p.grad is None for p in model.parameters())
        result = audit.result(claimed_epsilon=math.inf, delta=1e-5)
        assert result.num_canaries == 8 and result.exposure is not None
        assert not hasattr(callback, "included") and not hasattr(callback.scores, "included")

    def test_refuses_a_resumed_run(self):
        audit = CanaryAudit(CausalLMCanaries(4, range(3, VOCAB), 4, seed=0), seed=0)
        state = TrainerState()
        state.global_step = 5
        with pytest.raises(RuntimeError, match="score_initial"):
            audit.callback().on_train_begin(None, state, TrainerControl(), model=gpt2())

    def test_result_needs_both_scores(self):
        audit = CanaryAudit(CausalLMCanaries(4, range(3, VOCAB), 4, seed=0), seed=0)
        with pytest.raises(RuntimeError, match="initial model"):
            audit.result(claimed_epsilon=1.0, delta=1e-5)
        audit.score_initial(gpt2())
        with pytest.raises(RuntimeError, match="trained model"):
            audit.result(claimed_epsilon=1.0, delta=1e-5)
