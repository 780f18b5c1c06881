"""The three-line change for every Trainer task (issue 18): QA, multiple choice, label smoothing, seq2seq with
generation, eval-only runs, honest logs, tensorboard; and the trainer leaves the model a plain model (issue 17)."""

import copy
import glob
import math

import pytest
import torch
from helpers.models import VOCAB, bart, gpt2, t5
from helpers.trainer import (
    IndexedDataset,
    ListDataset,
    RecordingCollate,
    ToyDataset,
    causal_per_example_loss,
    check_exact_update,
    collate,
    dp_args,
    one_example_loss,
    sgd_step_args,
)
from transformers import (
    BertConfig,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_pt_utils import LabelSmoother

from hf_dp import DPSeq2SeqTrainer, DPSeq2SeqTrainingArguments, DPTrainer

SEQ = 8


def tiny_bert(cls, **kw):
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        **kw,
    )
    return cls(cfg)


def qa_dataset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        start = int(torch.randint(0, SEQ - 2, (1,), generator=g))
        end = start + int(torch.randint(0, 3, (1,), generator=g))
        items.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "start_positions": torch.tensor(start),
                "end_positions": torch.tensor(end),
            }
        )
    items[0]["end_positions"] = torch.tensor(SEQ + 3)  # out of range: ignored, as in HF's QA heads
    return ListDataset(items)


def choice_dataset(n, choices=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ListDataset(
        [
            {
                "input_ids": torch.randint(3, VOCAB, (choices, SEQ), generator=g),
                "attention_mask": torch.ones(choices, SEQ, dtype=torch.long),
                "labels": torch.tensor(int(torch.randint(0, choices, (1,), generator=g))),
            }
            for _ in range(n)
        ]
    )


def own_loss(model, example, smoothing=0.0):
    """The model's own loss on ONE example (batch of one): an independent per-example oracle."""
    batch = {k: v.unsqueeze(0) for k, v in example.items()}
    if smoothing:
        labels = batch.pop("labels")
        return LabelSmoother(epsilon=smoothing)(model(**batch), labels)
    return model(**batch).loss


class TestLossesOfEveryTask:
    def test_question_answering_exact(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = check_exact_update(tiny_bert(BertForQuestionAnswering).double(), qa_dataset(8), own_loss, tmp_dir)
        assert trainer.loss_type == "question_answering"

    def test_multiple_choice_exact(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = check_exact_update(tiny_bert(BertForMultipleChoice).double(), choice_dataset(8), own_loss, tmp_dir)
        assert trainer.loss_type == "multiple_choice"

    def test_label_smoothing_is_applied_per_example(self, float64, tmp_dir):
        torch.manual_seed(0)
        model = tiny_bert(BertForSequenceClassification, num_labels=3).double()
        dataset = ToyDataset(8, classification=True)
        check_exact_update(
            model, dataset, lambda m, ex: own_loss(m, ex, smoothing=0.2), tmp_dir, label_smoothing_factor=0.2
        )

    def test_compute_loss_func_receives_every_label_tensor(self, tmp_dir):
        seen = []

        def loss_func(outputs, labels):
            seen.append(sorted(labels))
            start = torch.nn.functional.cross_entropy(outputs.start_logits, labels["start_positions"], reduction="none")
            return start

        trainer = DPTrainer(
            model=tiny_bert(BertForQuestionAnswering),
            args=dp_args(tmp_dir, max_steps=1),
            train_dataset=qa_dataset(40),
            data_collator=collate,
            compute_loss_func=loss_func,
        )
        trainer.train()
        assert seen and all(names == ["end_positions", "start_positions"] for names in seen)


def test_activation_checkpointing_is_exact(float64, tmp_dir):
    torch.manual_seed(0)
    model = gpt2().double()
    dataset = ListDataset([ToyDataset(8)[i] for i in range(8)])

    # (HF's own causal-LM loss casts logits to float32: the float64 oracle loss is computed in the test instead)
    trainer = check_exact_update(model, dataset, one_example_loss, tmp_dir, gradient_checkpointing=True)
    assert trainer.args.activation_checkpointing


@pytest.mark.parametrize(
    "style,fn", [("layer-wise", "abadi"), ("transformer.h.*;transformer.w*,transformer.ln_f.*", "automatic")]
)
def test_clipping_policies_reach_the_engine(float64, tmp_dir, style, fn):
    """sigma = 0, q = 1, SGD lr = 1: the DPTrainer update is -(1/N) x the engine's clipped sum under that policy."""
    from hf_dp import BookKeepingClipper

    args = sgd_step_args(
        tmp_dir, per_sample_max_grad_norm=0.05, clipping_style=style, clipping_fn=fn, automatic_clipping_gamma=0.02
    )
    torch.manual_seed(0)
    model = gpt2().double()
    reference = copy.deepcopy(model)
    batch = collate([ToyDataset(8)[i] for i in range(8)])
    clipper = BookKeepingClipper(
        reference, max_grad_norm=0.05, clipping_style=args.clipping_style, clipping_fn=fn, gamma=0.02
    )
    clipper.backward(causal_per_example_loss(reference, batch))
    expected = {n: p.grad / 8 for n, p in reference.named_parameters()}
    clipper.remove()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    DPTrainer(model=model, args=args, train_dataset=ToyDataset(8), data_collator=collate).train()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach() - before[n], -expected[n], rtol=1e-6, atol=1e-10, msg=n)


def test_overriding_compute_loss_with_a_batch_mean_is_refused(tmp_dir):
    class MeanLoss(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss  # the model's batch mean: no per-example loss reaches the engine

    trainer = MeanLoss(
        model=gpt2(),
        args=dp_args(tmp_dir, max_steps=1, dp_self_check=False),
        train_dataset=ToyDataset(40),
        data_collator=collate,
    )
    with pytest.raises(ValueError, match="compute_per_example_loss"):
        trainer.train()
    assert trainer.clipper is None  # hooks removed although train() raised


class TestEvaluationAndLogs:
    def test_eval_only_trainer(self, tmp_dir):
        trainer = DPTrainer(model=gpt2(), args=dp_args(tmp_dir), eval_dataset=ToyDataset(8), data_collator=collate)
        assert math.isfinite(trainer.evaluate()["eval_loss"])
        assert trainer.predict(ToyDataset(4)).predictions.shape[0] == 4
        with pytest.raises(ValueError, match="train_dataset"):
            trainer.train()

    def test_eval_loss_equals_the_plain_trainers(self, tmp_dir):
        torch.manual_seed(0)
        model = gpt2()
        data = ToyDataset(8, seed=3)
        plain = Trainer(
            model=model, args=TrainingArguments(tmp_dir, report_to="none", use_cpu=True), data_collator=collate
        ).evaluate(data)["eval_loss"]
        private = DPTrainer(model=model, args=dp_args(tmp_dir), data_collator=collate).evaluate(data)["eval_loss"]
        assert private == pytest.approx(plain, rel=1e-6)

    def test_logged_loss_is_the_mean_over_the_examples_used(self, tmp_dir):
        """lr 0: the model is fixed, so each logged loss must be the mean of its step's per-example losses."""
        torch.manual_seed(0)
        model = gpt2()
        dataset = IndexedDataset(40)
        recorder = RecordingCollate()
        args = dp_args(
            tmp_dir,
            max_steps=4,
            learning_rate=0.0,
            optim="sgd",
            remove_unused_columns=False,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
        )
        trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=recorder)
        trainer.train()
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        model.eval()
        with torch.no_grad():
            per_example = [
                float(own_loss(model, {k: v for k, v in dataset[i].items() if k != "idx"})) for i in range(len(dataset))
            ]
        expected = [sum(per_example[i] for i in b) / len(b) for b in recorder.batches[:4]]
        assert all(recorder.batches[:4])
        assert logged == pytest.approx(expected, rel=1e-5)
        final = trainer.state.log_history[-1]["train_loss"]
        used = [i for b in recorder.batches[:4] for i in b]
        assert final == pytest.approx(sum(per_example[i] for i in used) / len(used), rel=1e-5)

    def test_epsilon_reaches_tensorboard(self, tmp_dir, monkeypatch):
        pytest.importorskip("tensorboard")
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", f"{tmp_dir}/tb")
        args = dp_args(tmp_dir, max_steps=3, report_to="tensorboard")
        DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate).train()
        files = glob.glob(f"{tmp_dir}/tb/**/events.out.tfevents.*", recursive=True)
        assert files
        events = EventAccumulator(files[0])
        events.Reload()
        by_step = {e.step: e.value for e in events.Scalars("train/epsilon")}
        assert sorted(by_step) == [1, 2, 3] and list(by_step.values()) == sorted(by_step.values())
        assert by_step[1] > 0

    def test_setup_is_visible_and_the_card_names_the_optimizer(self, tmp_dir, caplog):
        args = dp_args(tmp_dir, max_steps=2, noise_multiplier=None, target_epsilon=3.0, optim="adamw_torch")
        trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
        summary = trainer.dp_summary()
        assert summary["sample_rate"] == 0.2 and summary["num_examples"] == 40 and summary["target_epsilon"] == 3.0
        with caplog.at_level("WARNING"):
            trainer.train()
        line = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "sigma=" in r.getMessage())
        for text in (
            f"sigma={summary['noise_multiplier']:.4g}",
            "q=0.2",
            "N=40",
            "2 steps",
            "delta=0.0125",
            "target epsilon=3",
            "RDP",
        ):
            assert text in line, text
        trainer.save_model()
        card = open(f"{tmp_dir}/README.md", encoding="utf-8").read()
        assert "| Optimizer | AdamW |" in card and "AcceleratedOptimizer" not in card


def test_the_model_is_a_plain_model_after_train(tmp_dir):
    model = gpt2()
    hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    DPTrainer(
        model=model, args=dp_args(tmp_dir, max_steps=2), train_dataset=ToyDataset(40), data_collator=collate
    ).train()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == hooks_before
    copy.deepcopy(model)
    torch.save(model, f"{tmp_dir}/model.pt")
    model.zero_grad(set_to_none=True)
    batch = collate([ToyDataset(4)[i] for i in range(4)])
    model(**batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def seq2seq_dataset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        src_len, tgt_len = int(torch.randint(3, SEQ, (1,), generator=g)), int(torch.randint(2, 5, (1,), generator=g))
        items.append(
            {
                "input_ids": torch.randint(3, VOCAB, (src_len,), generator=g),
                "labels": torch.randint(3, VOCAB, (tgt_len,), generator=g),
            }
        )
    return ListDataset(items)


def seq2seq_collate(features):
    def pad(key, value):
        longest = max(len(f[key]) for f in features)
        return torch.stack([torch.nn.functional.pad(f[key], (0, longest - len(f[key])), value=value) for f in features])

    ids = pad("input_ids", 0)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": pad("labels", -100)}


@pytest.mark.parametrize("factory", [t5, bart], ids=["t5", "bart"])
def test_seq2seq_training_and_generation(tmp_dir, factory):
    torch.manual_seed(0)
    model = factory()
    args = DPSeq2SeqTrainingArguments(
        output_dir=tmp_dir,
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        noise_multiplier=1.0,
        learning_rate=1e-3,
        predict_with_generate=True,
        generation_max_length=6,
        generation_num_beams=2,
        save_strategy="no",
        disable_tqdm=True,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPSeq2SeqTrainer(model=model, args=args, train_dataset=seq2seq_dataset(40), data_collator=seq2seq_collate)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == {n for n, p in model.named_parameters() if p.requires_grad}
    test = seq2seq_dataset(4, seed=1)
    plain = Seq2SeqTrainer(
        model=model,
        args=Seq2SeqTrainingArguments(
            output_dir=tmp_dir,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            predict_with_generate=True,
            generation_max_length=6,
            generation_num_beams=2,
        ),
        data_collator=seq2seq_collate,
    )
    expected, got = plain.predict(test), trainer.predict(test)
    assert got.predictions.shape[0] == 4 and (got.predictions == expected.predictions).all()
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)
    assert trainer.evaluate(test)["eval_loss"] == pytest.approx(plain.evaluate(test)["eval_loss"], rel=1e-6)
