"""The audit end to end through the trainers' public API: a non-private run leaks (bound > 1), a DP run at
epsilon 1 does not refute its claim, and a planted bug (no noise while epsilon 1 is claimed) is caught."""

import dataclasses
import math
from unittest import mock

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
    Trainer,
    TrainingArguments,
)

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.audit import (
    CARD_FIELDS,
    AuditResult,
    CanaryAudit,
    CausalLMCanaries,
    ClassificationCanaries,
    MaskedLMCanaries,
)
from hf_dp.step.dp_step import DPStep

VOCAB = 32
NUM_CANARIES = 256  # ~128 in the training set: q = L / N ~ 1/4
DELTA = 1e-5


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def collate(features):
    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def training_args(tmp_dir, private, **dp):
    # Memorisation-friendly: canaries only, 20 epochs, a large constant learning rate.
    common = dict(
        output_dir=tmp_dir,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        per_device_train_batch_size=32,
        num_train_epochs=20,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        seed=0,
        disable_tqdm=True,
        logging_steps=1000,
        dataloader_pin_memory=False,
    )
    if not private:
        return TrainingArguments(**common)
    return DPTrainingArguments(**common, target_delta=DELTA, per_sample_max_grad_norm=1.0, noise_seed=0, **dp)


def audited_run(tmp_dir, private, planted_bug=False):
    canaries = CausalLMCanaries(NUM_CANARIES, range(2, VOCAB), 8, prefix_ids=[1], seed=0)
    audit = CanaryAudit(canaries, seed=1, num_alternatives=100)
    kwargs = dict(
        model=tiny_gpt2(), train_dataset=audit.training_set(), data_collator=collate, callbacks=[audit.callback()]
    )
    if not private:
        Trainer(args=training_args(tmp_dir, False), **kwargs).train()
        return audit.result(claimed_epsilon=math.inf, delta=DELTA), None
    trainer = DPTrainer(args=training_args(tmp_dir, True, target_epsilon=1.0), **kwargs)
    noise_calls = []
    if planted_bug:
        # The one documented hook: DPStep.add_noise adds the Gaussian noise. A no-op drops it.
        with mock.patch.object(DPStep, "add_noise", lambda self, *a, **k: noise_calls.append(1)):
            trainer.train()
        assert noise_calls, "DPStep never called `add_noise`: the planted bug did not take effect."
    else:
        trainer.train()
    return audit.result(claimed_epsilon=trainer.epsilon(), delta=trainer.delta), trainer


class TestAuditEndToEnd:
    def test_non_private_training_leaks(self, tmp_dir):
        result, _ = audited_run(tmp_dir, private=False)
        assert result.epsilon_lower_bound > 2.0
        assert result.exposure > result.exposure_excluded + 2.0  # members' secrets rank near the top
        assert result.num_correct / result.num_guesses > 0.95

    def test_dp_epsilon_1_is_not_refuted(self, tmp_dir):
        result, trainer = audited_run(tmp_dir, private=True)
        assert result.claimed_epsilon == pytest.approx(1.0, abs=1e-2)
        assert result.epsilon_lower_bound <= 1.0
        assert not result.exceeds_claim
        assert trainer.dp_noise_multiplier > 1  # the run really was noisy

    def test_planted_bug_is_caught(self, tmp_dir):
        result, trainer = audited_run(tmp_dir, private=True, planted_bug=True)
        assert result.claimed_epsilon == pytest.approx(1.0, abs=1e-2)  # the trainer still claims epsilon 1
        assert result.epsilon_lower_bound > 1.0 and result.exceeds_claim

    def test_card_fields(self):
        result = AuditResult(
            claimed_epsilon=1.0,
            epsilon_lower_bound=0.2,
            num_canaries=256,
            num_included=130,
            num_tested=256,
            num_guesses=50,
            num_correct=30,
            k_plus=25,
            k_minus=25,
            significance=0.05,
            delta=1e-5,
            selection="bonferroni",
            num_choices=12,
        )
        assert (
            tuple(result.card_fields())
            == CARD_FIELDS
            == ("claimed_epsilon", "epsilon_lower_bound", "num_canaries", "significance", "delta")
        )
        assert result.card_fields()["epsilon_lower_bound"] == 0.2 and result.card_fields()["num_canaries"] == 256
        with_exposure = dataclasses.replace(result, exposure=2.5).card_fields()
        assert tuple(with_exposure) == (*CARD_FIELDS, "exposure") and with_exposure["exposure"] == 2.5
        assert math.isinf(dataclasses.replace(result, claimed_epsilon=math.inf).card_fields()["claimed_epsilon"])
        assert dataclasses.replace(result, claimed_epsilon=math.inf).to_dict()["claimed_epsilon"] is None


def pad_collate(features, pad_token_id):
    longest = max(len(f["input_ids"]) for f in features)
    batch = {}
    for key in features[0]:
        values = [f[key] for f in features]
        if values[0].dim() == 0:  # class labels
            batch[key] = torch.stack(values)
            continue
        fill = {"labels": -100, "attention_mask": 0, "input_ids": pad_token_id}[key]
        batch[key] = torch.stack([torch.nn.functional.pad(v, (0, longest - len(v)), value=fill) for v in values])
    return batch


class TestOtherCanaryKinds:
    """Non-private runs: the classifier's mislabelled canaries and the masked LM's key -> secret canaries leak."""

    @staticmethod
    def run(tmp_dir, model, canaries, **audit_kwargs):
        audit = CanaryAudit(canaries, seed=1, **audit_kwargs)
        args = TrainingArguments(
            output_dir=tmp_dir,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            per_device_train_batch_size=32,
            num_train_epochs=30,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            seed=0,
            disable_tqdm=True,
            logging_steps=1000,
            dataloader_pin_memory=False,
        )
        Trainer(
            model=model,
            args=args,
            train_dataset=audit.training_set(),
            callbacks=[audit.callback()],
            data_collator=lambda f: pad_collate(f, canaries.pad_token_id),
        ).train()
        return audit.result(claimed_epsilon=math.inf, delta=DELTA)

    def test_mislabelled_examples(self, tmp_dir):
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=2,
            pad_token_id=0,
        )
        canaries = ClassificationCanaries(NUM_CANARIES, 2, token_ids=range(3, VOCAB), length=8, seed=0)
        result = self.run(tmp_dir, BertForSequenceClassification(config), canaries)
        assert result.epsilon_lower_bound > 0.5 and result.exposure is None

    def test_masked_lm_secrets(self, tmp_dir):
        torch.manual_seed(0)
        config = RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=20,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=1,
        )
        canaries = MaskedLMCanaries(
            NUM_CANARIES, range(3, VOCAB), key_length=4, secret_length=2, mask_token_id=2, pad_token_id=1, seed=0
        )
        result = self.run(tmp_dir, RobertaForMaskedLM(config), canaries, num_alternatives=50)
        assert result.epsilon_lower_bound > 1.5
        assert result.exposure > result.exposure_excluded + 1.0
