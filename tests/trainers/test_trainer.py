"""DPTrainer end to end on tiny models from configs (CPU, offline)."""

import copy
import json
import math
import os

import pytest
import torch
from helpers.models import VOCAB, bert_classifier, gpt2
from helpers.trainer import (
    ToyDataset,
    check_exact_update,
    collate,
    dp_args,
    one_example_loss,
    pad_collate,
    sgd_step_args,
)
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.accounting import epsilon as accounting_epsilon
from hf_dp.accounting import noise_multiplier as calibrate
from hf_dp.release.model_card import format_bound


class TestExactUpdate:
    @pytest.mark.parametrize(
        "kind,strategy",
        [("gpt2-tied", "random"), ("bert-classifier", "random"), ("gpt2-tied", "group_by_length")],
    )
    def test_one_sgd_step_is_the_clipped_mean(self, float64, tmp_dir, kind, strategy):
        """sigma = 0, q = 1, SGD lr = 1: the update is exactly -(1/N) sum_i clip(g_i), whether or not micro-batches
        are grouped by length (variable-length examples, padded per micro-batch)."""
        torch.manual_seed(0)
        classification = kind == "bert-classifier"
        model = (bert_classifier() if classification else gpt2()).double()
        n = 8
        dataset = ToyDataset(n, classification=classification, trim=True)
        padded_tokens = []

        def counting_collate(features):
            batch = pad_collate(features)
            padded_tokens.append(batch["input_ids"].numel())
            return batch

        trainer = check_exact_update(
            model, dataset, one_example_loss, tmp_dir, data_collator=counting_collate, train_sampling_strategy=strategy
        )
        assert trainer.dp_callback.steps == 1
        if strategy == "group_by_length":  # the longest half first: exactly the least padding for two micro-batches
            lengths = sorted((len(dataset[i]["input_ids"]) for i in range(n)), reverse=True)
            assert padded_tokens == [4 * lengths[0], 4 * lengths[4]]

    def test_noise_has_the_calibrated_scale(self, tmp_dir):
        """The noise part of the update has norm sigma * C * sqrt(P) / L (within 10%)."""
        torch.manual_seed(0)
        model = gpt2()
        dataset = ToyDataset(8)
        sigma, clip, n = 3.0, 0.5, 8
        clean_model = copy.deepcopy(model)
        DPTrainer(
            model=clean_model,
            args=sgd_step_args(tmp_dir, per_sample_max_grad_norm=clip),
            train_dataset=dataset,
            data_collator=collate,
        ).train()
        before = [p.detach().clone() for p in model.parameters()]
        DPTrainer(
            model=model,
            args=sgd_step_args(tmp_dir, per_sample_max_grad_norm=clip, noise_multiplier=sigma),
            train_dataset=dataset,
            data_collator=collate,
        ).train()
        noise = torch.cat(
            [
                ((a.detach() - b) - (c.detach() - b)).flatten()
                for a, b, c in zip(model.parameters(), before, clean_model.parameters(), strict=True)
            ]
        )
        num_params = noise.numel()
        expected = sigma * clip * math.sqrt(num_params) / n
        assert float(noise.norm()) == pytest.approx(expected, rel=0.1)


class EpsilonRecorder(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


class TestPrivacyAccounting:
    def test_epsilon_logged_every_step_and_matches_accounting(self, tmp_dir):
        torch.manual_seed(0)
        dataset = ToyDataset(40)
        args = dp_args(tmp_dir, max_steps=6, epsilon_accountants=["rdp", "gdp", "prv"])
        trainer = DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=collate)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert [h["step"] for h in logs] == list(range(1, 7))
        q, delta = 8 / 40, 1 / 80
        for h in logs:
            for name in ("rdp", "gdp", "prv"):
                assert h[f"epsilon_{name}"] == pytest.approx(
                    accounting_epsilon(1.0, q, h["step"], delta, name), rel=1e-9
                )
            assert h["epsilon"] == h["epsilon_rdp"]
        eps = [h["epsilon"] for h in logs]
        assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
        assert trainer.dp_callback.steps == trainer.state.global_step == 6

    def test_target_epsilon_calibration(self, tmp_dir):
        dataset = ToyDataset(40)
        args = dp_args(tmp_dir, noise_multiplier=None, target_epsilon=2.0, num_train_epochs=1, accountant="rdp")
        trainer = DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=collate)
        assert trainer.num_dp_steps == math.ceil(1 / (8 / 40))  # ceil(epochs / q)
        assert trainer.dp_noise_multiplier == pytest.approx(calibrate(2.0, 1 / 80, 0.2, 5), rel=1e-12)
        trainer.train()
        assert trainer.state.global_step == 5
        assert trainer.epsilon() <= 2.0
        assert trainer.state.log_history[-1]["epsilon"] <= 2.0

    def test_budget_stop(self, tmp_dir):
        """A schedule that grows past the calibrated one (here a subclass that runs 40 steps where the plan has 5)
        stops at the budget."""

        class Longer(DPTrainer):
            def set_initial_training_values(self, args, dataloader, *rest):
                values = list(super().set_initial_training_values(args, dataloader, *rest))
                values[0], values[-1] = 100, 40
                return tuple(values)

        dataset = ToyDataset(40)
        args = dp_args(tmp_dir, noise_multiplier=None, target_epsilon=2.0, max_steps=5)
        trainer = Longer(model=gpt2(), args=args, train_dataset=dataset, data_collator=collate)
        trainer.train()
        assert trainer.epsilon() <= 2.0
        assert 5 <= trainer.state.global_step < 40
        assert accounting_epsilon(trainer.dp_noise_multiplier, 0.2, trainer.state.global_step + 1, 1 / 80) > 2.0

    def test_empty_poisson_batches_still_step(self, tmp_dir):
        """q = 1/40: most logical batches are empty; each still takes a (noise-only) step and counts."""
        torch.manual_seed(0)
        dataset = ToyDataset(40)
        args = dp_args(tmp_dir, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=12)
        model = gpt2()
        before = [p.detach().clone() for p in model.parameters()]
        trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
        sizes = [len(b) for b in trainer.get_train_dataloader().batch_sampler]
        assert 0 in sizes
        trainer.train()
        assert trainer.state.global_step == 12 == trainer.dp_callback.steps
        assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


class TestResume:
    def test_resume_continues_epsilon_and_weights(self, tmp_dir):
        dataset = ToyDataset(40)
        common = dict(max_steps=6, save_strategy="steps", save_steps=3, noise_multiplier=1.0)

        torch.manual_seed(0)
        full_model = gpt2()
        init = copy.deepcopy(full_model.state_dict())
        full = DPTrainer(
            model=full_model,
            args=dp_args(os.path.join(tmp_dir, "full"), **common),
            train_dataset=dataset,
            data_collator=collate,
        )
        full.train()

        part_dir = os.path.join(tmp_dir, "part")
        model = gpt2()
        model.load_state_dict(init)
        interrupted = DPTrainer(
            model=model, args=dp_args(part_dir, **common), train_dataset=dataset, data_collator=collate
        )

        class StopAt3(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    control.should_training_stop = True

        interrupted.add_callback(StopAt3())
        interrupted.train()
        assert interrupted.dp_callback.steps == 3

        model = gpt2()
        model.load_state_dict(init)
        resumed = DPTrainer(model=model, args=dp_args(part_dir, **common), train_dataset=dataset, data_collator=collate)
        assert resumed.dp_callback.steps == 0
        resumed.train(resume_from_checkpoint=True)
        assert resumed.dp_callback.steps == 6
        assert resumed.epsilon() == pytest.approx(full.epsilon(), rel=1e-12)
        assert resumed.state.log_history[-1]["epsilon"] == pytest.approx(full.state.log_history[-1]["epsilon"])
        for (name, a), b in zip(resumed.model.state_dict().items(), full.model.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


class TestPeftAndRelease:
    def test_lora_changes_only_adapters_and_saves(self, tmp_dir):
        from peft import LoraConfig, PeftModel, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = dp_args(tmp_dir, max_steps=3, learning_rate=1e-2)
        trainer = DPTrainer(model=model, args=args, train_dataset=ToyDataset(40), data_collator=collate)
        trainer.train()
        changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        assert changed and all("lora_" in n for n in changed)
        assert changed == {n for n, p in model.named_parameters() if p.requires_grad}
        out = os.path.join(tmp_dir, "adapter")
        trainer.save_model(out)
        assert os.path.exists(os.path.join(out, "adapter_config.json"))
        assert not any(f.startswith("model") for f in os.listdir(out))
        card = open(os.path.join(out, "README.md")).read()
        assert "## Differential privacy" in card and "differential-privacy" in card
        torch.manual_seed(1)
        reloaded = PeftModel.from_pretrained(gpt2(), out)
        for n, p in reloaded.named_parameters():
            if "lora_" in n:
                torch.testing.assert_close(p, dict(model.named_parameters())[n])

    def test_model_card_and_offline_push(self, tmp_dir, monkeypatch):
        import transformers.trainer as trainer_module

        uploaded = {}

        class FakeApi:
            def create_repo(self, repo_id, **kwargs):
                return type("Repo", (), {"repo_id": f"user/{repo_id}"})()

            def upload_folder(self, repo_id, folder_path, **kwargs):
                uploaded["repo_id"] = repo_id
                uploaded["files"] = {
                    f: open(os.path.join(folder_path, f), "rb").read()
                    for f in os.listdir(folder_path)
                    if os.path.isfile(os.path.join(folder_path, f))
                }

        monkeypatch.setattr(trainer_module, "hf_api", lambda: FakeApi())
        args = dp_args(tmp_dir, max_steps=2, hub_model_id="dp-toy")
        trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
        trainer.train()
        trainer.push_to_hub()
        files = uploaded["files"]
        assert "model.safetensors" in files and "config.json" in files
        card = files["README.md"].decode()
        eps = trainer.epsilon()
        for text in [
            "## Differential privacy",
            "differential-privacy",
            "hf-dp",
            "one training example",
            format_bound(eps),
            "Poisson",
            "bk-mixopt",
            f"{trainer.delta:.3g}",
            "| Noisy steps | 2 |",
        ]:
            assert text in card, text
        config = json.loads(files["config.json"])
        assert config["model_type"] == "gpt2"  # the plain model, not a wrapper


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ToyDataset(4)


class TestBadInput:
    @pytest.mark.parametrize(
        "overrides,match",
        [
            ({"target_epsilon": 0.0, "noise_multiplier": None}, "target_epsilon"),
            ({"target_epsilon": -1.0, "noise_multiplier": None}, "target_epsilon"),
            ({"target_epsilon": 3.0}, "exactly one"),
            ({"noise_multiplier": None}, "exactly one"),
            ({"max_grad_norm": 1.0}, "max_grad_norm"),
            ({"target_delta": 1.5}, "target_delta"),
            ({"dataloader_drop_last": True}, "dataloader_drop_last"),
            ({"train_sampling_strategy": "batch_rebalance"}, "batch_rebalance"),
            ({"train_sampling_strategy": "sequential"}, "sequential"),
            ({"per_sample_max_grad_norm": 0.0}, "per_sample_max_grad_norm"),
            ({"accountant": "moments"}, "accountant"),
            ({"clipping_mode": "ghost"}, "ghost"),
            ({"accountant": "gdp"}, "estimate"),
            ({"torch_compile": True}, "torch_compile"),
            ({"neftune_noise_alpha": 5.0}, "NEFTune"),
            ({"auto_find_batch_size": True}, "auto_find_batch_size"),
            ({"clipping_style": "per-layer"}, "clipping_style"),
            ({"clipping_style": ";"}, "clipping_style"),
            ({"clipping_fn": "huber"}, "clipping_fn"),
            ({"automatic_clipping_gamma": 0.0}, "automatic_clipping_gamma"),
        ],
    )
    def test_argument_errors(self, tmp_dir, overrides, match):
        with pytest.raises(ValueError, match=match):
            dp_args(tmp_dir, **overrides)

    def test_trainer_errors(self, tmp_dir):
        args = dp_args(tmp_dir)
        with pytest.raises(ValueError, match="DPTrainingArguments"):
            DPTrainer(model=gpt2(), args=TrainingArguments(output_dir=tmp_dir), train_dataset=ToyDataset(8))
        with pytest.raises(ValueError, match="map-style"):
            DPTrainer(model=gpt2(), args=args, train_dataset=Stream())
        with pytest.raises(ValueError, match="larger than the training set"):
            DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(4), data_collator=collate)
        bn_model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
        with pytest.raises(ValueError, match="BatchNorm"):
            DPTrainer(model=bn_model, args=args, train_dataset=ToyDataset(40))
        tuples = [(torch.ones(3, dtype=torch.long),)] * 40
        grouped = DPTrainer(
            model=gpt2(), args=dp_args(tmp_dir, train_sampling_strategy="group_by_length"), train_dataset=tuples
        )
        with pytest.raises(ValueError, match="length"):
            grouped.get_train_dataloader()

    def test_delta_at_or_above_one_over_n_is_refused(self, tmp_dir):
        for delta in (0.1, 1 / 40):
            with pytest.raises(ValueError, match="1/N"):
                DPTrainer(model=gpt2(), args=dp_args(tmp_dir, target_delta=delta), train_dataset=ToyDataset(40))


def test_hf_argument_parser_parses_dp_fields(tmp_dir):
    parser = HfArgumentParser(DPTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            tmp_dir,
            "--target_epsilon",
            "3",
            "--per_sample_max_grad_norm",
            "0.2",
            "--accountant",
            "prv",
            "--epsilon_accountants",
            "rdp",
            "gdp",
            "--clipping_mode",
            "bk",
            "--poisson_sampling",
            "false",
            "--per_example_loss_reduction",
            "sum",
            "--report_to",
            "none",
        ]
    )
    assert args.target_epsilon == 3.0 and args.per_sample_max_grad_norm == 0.2 and args.accountant == "prv"
    assert args.epsilon_accountants == ["rdp", "gdp"] and args.clipping_mode == "bk" and not args.poisson_sampling
    assert args.max_grad_norm == 0.0
    help_text = parser.format_help()
    for name in [
        "--target_epsilon",
        "--noise_multiplier",
        "--target_delta",
        "--per_sample_max_grad_norm",
        "--accountant",
        "--clipping_mode",
        "--poisson_sampling",
        "--per_example_loss_reduction",
    ]:
        assert name in help_text


class LogRecorder(TrainerCallback):
    """Stands for any `report_to` integration: they all receive `logs` through `on_log`."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_epsilon_reaches_reporting_callbacks_and_bf16(tmp_dir):
    recorder = LogRecorder()
    args = dp_args(tmp_dir, max_steps=3, bf16=True, save_strategy="steps", save_steps=3)
    trainer = DPTrainer(
        model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate, callbacks=[recorder]
    )
    trainer.train()
    train_logs = [log for log in recorder.logs if "loss" in log]
    assert len(train_logs) == 3 and all("epsilon" in log and "epsilon_prv" in log for log in train_logs)
    assert all(math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"]) for log in train_logs)
    with open(os.path.join(tmp_dir, "checkpoint-3", "trainer_state.json")) as f:
        state = json.load(f)
    assert all("epsilon" in h for h in state["log_history"] if "loss" in h)
    assert state["stateful_callbacks"]["DPCallback"]["attributes"]["history"] == [[1.0, 0.2, 3]]


def test_evaluation_uses_the_mean_loss(tmp_dir):
    args = dp_args(tmp_dir, max_steps=1, eval_strategy="no")
    dataset = ToyDataset(40)
    trainer = DPTrainer(
        model=gpt2(), args=args, train_dataset=dataset, eval_dataset=ToyDataset(8, seed=1), data_collator=collate
    )
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and 1.0 < metrics["eval_loss"] < 2 * math.log(VOCAB)
