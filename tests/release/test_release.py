"""What leaves the process (issue 16): no noise secret and no un-noised training statistic in any written or pushed
file; the user's arguments stay theirs."""

import json
import math
import os
import pickle

import numpy as np
import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args

from hf_dp import DPTrainer
from hf_dp.release.filter import released_log_history
from hf_dp.step.noise import NoiseSource

UNRELEASED_KEYS = ("loss", "train_loss", "num_input_tokens_seen", "total_flos", "train_runtime")


class NoiseRecorder:
    """Wraps NoiseSource.normal to keep the noise of every step and the source's secret, as an attacker would wish."""

    def __init__(self, monkeypatch):
        self.draws, self.sources = [], []
        original = NoiseSource.normal

        def normal(source, **kwargs):
            out = original(source, **kwargs)
            self.draws.append((kwargs["step"], kwargs["std"], [t.clone() for t in out]))
            self.sources.append(source)
            return out

        monkeypatch.setattr(NoiseSource, "normal", normal)


def all_files(root):
    for folder, _, files in os.walk(root):
        for name in files:
            yield os.path.join(folder, name)


def integers_in(value):
    """Every integer (or integer-valued number) in a JSON value."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, float) and value.is_integer() and abs(value) < 2**128:
        yield int(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from integers_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from integers_in(v)


def keys_in(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, v
            yield from keys_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from keys_in(v)


def train_with_everything(tmp_dir, monkeypatch, **overrides):
    recorder = NoiseRecorder(monkeypatch)
    args = dp_args(
        tmp_dir,
        noise_seed=None,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        include_num_input_tokens_seen="all",
        **overrides,
    )
    torch.manual_seed(0)
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    output = trainer.train()
    trainer.save_state()
    trainer.save_metrics("train", output.metrics)
    trainer.save_model()
    trainer.create_model_card()
    return trainer, recorder, output


class TestNoiseSecret:
    def test_no_file_regenerates_the_first_noise(self, tmp_dir, monkeypatch):
        trainer, recorder, _ = train_with_everything(tmp_dir, monkeypatch)
        first_step, std, first_noise = recorder.draws[0]
        std = std[0] if isinstance(std, list) else std  # the first tensor's
        secret = recorder.sources[0]._base
        assert len({s._base for s in recorder.sources}) == 1  # one source per start
        shapes = [t.shape for t in first_noise]
        texts = {path: open(path, "rb").read() for path in all_files(tmp_dir)}
        assert any(p.endswith("trainer_state.json") for p in texts) and any("checkpoint-2" in p for p in texts)
        for path, raw in texts.items():
            assert str(secret).encode() not in raw, path
            assert b'noise_seed": ' not in raw.replace(b'noise_seed": null', b""), path
            assert b"noise_generator" not in raw, path

        def regenerates(candidate):
            return torch.allclose(candidate.float().reshape(first_noise[0].shape), first_noise[0], atol=1e-6)

        candidates = set()
        for path, raw in texts.items():
            if path.endswith(".json"):
                candidates.update(integers_in(json.loads(raw)))
        candidates.update({0, 42, trainer.args.seed, first_step})
        for value in candidates:
            if not 0 <= value < 2**128:
                continue
            noise = NoiseSource(value).normal(
                step=first_step, shapes=shapes, std=std, device="cpu", dtype=torch.float32
            )
            assert not regenerates(noise[0]), f"integer {value} regenerates the noise"
        # The RNG states the Trainer saves with checkpoints (python, numpy, torch) regenerate nothing either.
        for path in texts:
            if os.path.basename(path).startswith("rng_state"):
                states = torch.load(path, weights_only=False)
                g = torch.Generator().set_state(states["cpu"])
                assert not regenerates(torch.normal(0.0, std, shapes[0], generator=g))
                rs = np.random.RandomState()
                rs.set_state(states["numpy"])
                assert not regenerates(torch.from_numpy(rs.standard_normal(shapes[0]) * std))

    def test_every_start_draws_a_new_secret(self, tmp_dir, monkeypatch):
        recorder = NoiseRecorder(monkeypatch)
        trainer = DPTrainer(
            model=gpt2(),
            args=dp_args(tmp_dir, noise_seed=None, max_steps=1),
            train_dataset=ToyDataset(40),
            data_collator=collate,
        )
        trainer.train()
        trainer.train()
        assert len({s._base for s in recorder.sources}) == 2
        assert not torch.equal(recorder.draws[0][2][0], recorder.draws[1][2][0])

    def test_noise_source_cannot_be_pickled_and_fixed_seeds_are_per_step(self):
        with pytest.raises(TypeError, match="secret"):
            pickle.dumps(NoiseSource())
        a, b = NoiseSource(7), NoiseSource(7)
        kw = dict(shapes=[(5,)], std=1.0, device="cpu", dtype=torch.float32)
        assert torch.equal(a.normal(step=3, **kw)[0], b.normal(step=3, **kw)[0])
        assert not torch.equal(a.normal(step=3, **kw)[0], a.normal(step=4, **kw)[0])
        assert "7" not in repr(a)

    def test_secure_noise_is_standard_normal(self):
        source = NoiseSource(secure=True)
        x = source.normal(step=0, shapes=[(200_000,)], std=2.0, device="cpu", dtype=torch.float64)[0]
        assert abs(float(x.mean())) < 0.03 and float(x.std()) == pytest.approx(2.0, rel=0.01)
        assert float(((x / 2) ** 4).mean()) == pytest.approx(3.0, rel=0.05)  # Gaussian kurtosis
        again = source.normal(step=0, shapes=[(10,)], std=1.0, device="cpu", dtype=torch.float32)[0]
        assert not torch.equal(
            again, source.normal(step=0, shapes=[(10,)], std=1.0, device="cpu", dtype=torch.float32)[0]
        )


class TestReleasedStatistics:
    def test_no_raw_training_statistic_in_written_files(self, tmp_dir, monkeypatch):
        trainer, _, output = train_with_everything(tmp_dir, monkeypatch)
        assert "train_loss" in output.metrics and math.isfinite(output.training_loss)  # local: still there
        assert any("loss" in h for h in trainer.state.log_history)  # local log history keeps it
        seen = []
        for path in all_files(tmp_dir):
            if path.endswith(".json"):
                data = json.loads(open(path, encoding="utf-8").read())
                for key, value in keys_in(data):
                    if key in UNRELEASED_KEYS:
                        assert key in ("total_flos", "num_input_tokens_seen") and value == 0, (path, key, value)
                    seen.append(key)
        assert "epsilon" in seen and "grad_norm" in seen  # noised and public values are kept
        card = open(os.path.join(tmp_dir, "README.md"), encoding="utf-8").read()
        assert "Training Loss" not in card and "train_loss" not in card

    def test_publish_training_metrics_opt_in(self, tmp_dir, monkeypatch):
        train_with_everything(tmp_dir, monkeypatch, publish_training_metrics=True)
        state = json.load(open(os.path.join(tmp_dir, "trainer_state.json"), encoding="utf-8"))
        assert any("loss" in h for h in state["log_history"]) and state["num_input_tokens_seen"] > 0
        assert "train_loss" in json.load(open(os.path.join(tmp_dir, "train_results.json"), encoding="utf-8"))

    def test_released_log_history_is_an_allowlist(self):
        history = [
            {"loss": 1.0, "grad_norm": 2.0, "learning_rate": 0.1, "epsilon": 0.5, "epsilon_prv": 0.4, "step": 1},
            {"eval_loss": 3.0, "eval_accuracy": 0.5, "step": 1, "epoch": 0.1},
            {"train_runtime": 3.0, "train_loss": 1.0, "total_flos": 7, "my_custom_sum": 4, "step": 2},
        ]
        assert released_log_history(history) == [
            {"grad_norm": 2.0, "learning_rate": 0.1, "epsilon": 0.5, "epsilon_prv": 0.4, "step": 1},
            {"eval_loss": 3.0, "eval_accuracy": 0.5, "step": 1, "epoch": 0.1},
        ]
        assert released_log_history(history, publish=True) == history


@pytest.mark.parametrize("hub_strategy", ["every_save", "checkpoint"])
def test_pushed_files_hold_no_secret_or_raw_statistic(tmp_dir, monkeypatch, hub_strategy):
    """An offline push (hub API intercepted): every uploaded file, at the time of its upload."""
    import fnmatch

    import transformers.trainer as trainer_module

    uploads = []

    class Future:
        def done(self):
            return True

        def result(self):
            return None

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": f"user/{repo_id}"})()

        def upload_folder(self, repo_id, folder_path, path_in_repo=None, ignore_patterns=(), run_as_future=False, **kw):
            for path in all_files(folder_path):
                rel = os.path.relpath(path, folder_path)
                if any(fnmatch.fnmatch(rel, pattern) for pattern in ignore_patterns or ()):
                    continue
                uploads.append((os.path.join(path_in_repo or "", rel), open(path, "rb").read()))
            return Future() if run_as_future else None

    monkeypatch.setattr(trainer_module, "hf_api", lambda: FakeApi())
    recorder = NoiseRecorder(monkeypatch)
    args = dp_args(
        tmp_dir,
        noise_seed=None,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        push_to_hub=True,
        hub_model_id="dp-toy",
        hub_strategy=hub_strategy,
        include_num_input_tokens_seen="all",
    )
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    trainer.train()
    trainer.push_to_hub()
    names = {name for name, _ in uploads}
    assert "README.md" in names and "model.safetensors" in names
    if hub_strategy == "checkpoint":
        assert "last-checkpoint/trainer_state.json" in names
    secret = str(recorder.sources[0]._base).encode()
    for name, raw in uploads:
        assert secret not in raw, name
        if name.endswith(".json"):
            for key, value in keys_in(json.loads(raw)):
                assert key not in UNRELEASED_KEYS or value == 0, (name, key, value)
    card = dict(uploads)["README.md"].decode()
    assert "Training Loss" not in card


def test_user_arguments_are_never_modified(tmp_dir):
    args = dp_args(tmp_dir, max_steps=-1, num_train_epochs=1, noise_multiplier=None, target_epsilon=3.0)
    before = args.to_dict()
    small = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    large = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(80), data_collator=collate)
    assert (small.num_dp_steps, large.num_dp_steps) == (5, 10)  # ceil(epochs / q), q = 8/40 and 8/80
    small.train()
    assert small.state.global_step == 5
    large.train()
    assert large.state.global_step == 10
    assert args.to_dict() == before and args.max_steps == -1
