"""The noise state of banded correlated noise never leaves the process (issue 41): after a banded run that saves
checkpoints, saves the model and pushes to a (fake) Hub, no file under ``output_dir`` and no upload holds the bytes of
the noise buffers (the last b - 1 rows of C^-1 Z) or the secret seed that regenerates them."""

from __future__ import annotations

import os
from collections import deque

import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args
from test_release_paths import files_under, hub  # noqa: F401  (the fake Hub fixture)

import hf_dp.trainers.mixin as mixin
from hf_dp import DPTrainer
from hf_dp.step.noise import NoiseSource


def tensors_in(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor an object holds (attributes, lists, tuples, dicts), however the source names its buffers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v, seen)]
    if isinstance(obj, list | tuple | deque | set):
        return [t for v in obj for t in tensors_in(v, seen)]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return [t for v in vars(obj).values() for t in tensors_in(v, seen)]
    return []


def needles(buffers: list[torch.Tensor], seeds: list[int]) -> dict[str, bytes]:
    """Byte strings that would appear in a file holding the buffers (float32 pairs of a few coefficients of each,
    also as float16/bfloat16 and float64) or a seed (decimal, 16-byte little and big endian)."""
    found = {}
    for k, buffer in enumerate(buffers):
        flat = buffer.detach().flatten().float()
        for at in (0, flat.numel() // 2, flat.numel() - 2):
            pair = flat[at : at + 2]
            found[f"buffer {k}[{at}] float32"] = pair.numpy().tobytes()
            found[f"buffer {k}[{at}] float64"] = pair.double().numpy().tobytes()
        found[f"buffer {k} bfloat16 x4"] = flat[:4].to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    for k, seed in enumerate(seeds):
        found[f"seed {k} decimal"] = str(seed).encode()
        found[f"seed {k} le"] = seed.to_bytes(16, "little")
        found[f"seed {k} be"] = seed.to_bytes(16, "big")
    return found


def test_the_noise_state_and_its_seed_are_in_no_file_and_no_upload(tmp_dir, hub, monkeypatch):  # noqa: F811
    captured = {}
    streams = mixin.noise_streams

    def capturing(plan, base, counts, trainer=None):
        out = streams(plan, base, counts, trainer)
        captured["noise"], captured["seed"] = out[0], base._base
        return out

    monkeypatch.setattr(mixin, "noise_streams", capturing)
    secret_streams = DPTrainer._secret_streams

    def keep_sampling_seed(self):
        out = secret_streams(self)
        captured["sampling_seed"] = out[2]
        return out

    monkeypatch.setattr(DPTrainer, "_secret_streams", keep_sampling_seed)
    args = dp_args(
        tmp_dir,
        noise_seed=None,  # the OS's secret, as in a real run (a fixed test seed is in the arguments by design)
        max_steps=5,  # stops mid-cycle: the state holds rows of an unfinished cycle
        noise_mechanism="banded-toeplitz",
        noise_bands=3,
        save_strategy="steps",
        save_steps=2,
        push_to_hub=True,
        hub_model_id="dp-banded",
        hub_strategy="all_checkpoints",
    )
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    trainer.push_to_hub()
    trainer.model.save_pretrained(os.path.join(tmp_dir, "model_saved_by_hand"))

    noise = captured["noise"]
    assert not isinstance(noise, NoiseSource)  # the correlated source, not DP-SGD's
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    buffers = [t for t in tensors_in(noise) if t.numel() > 1]
    assert sum(t.numel() for t in buffers) >= 2 * trainable  # b - 1 = 2 rows of the trainable parameters' shape
    assert all(torch.count_nonzero(t) > 0 for t in buffers)
    found = needles(buffers, [captured["seed"], captured["sampling_seed"]])

    files = {f"output_dir/{k}": v for k, v in files_under(tmp_dir).items()}
    assert any(name.endswith("optimizer.pt") for name in files) and any("README.md" in name for name in files)
    for u, upload in enumerate(hub.uploads):
        files.update({f"upload {u}/{k}": v for k, v in upload["files"].items()})
    assert len(hub.uploads) >= 3
    leaks = [(what, name) for name, data in files.items() for what, needle in found.items() if needle in data]
    assert leaks == []

    card = files["output_dir/README.md"].decode()
    assert "cyclic Poisson" in card and "b = 3 bands" in card and "never written or uploaded" in card


def test_the_scan_finds_a_buffer_that_was_written(tmp_dir):
    """The needles are found in a file that holds a buffer (the scan above can fail)."""
    buffer = torch.randn(3, 5)
    path = os.path.join(tmp_dir, "leak.pt")
    torch.save({"state": [buffer]}, path)
    with open(path, "rb") as f:
        data = f.read()
    found = needles([buffer], [2**100 + 12345])
    assert any(needle in data for what, needle in found.items() if what.startswith("buffer"))
    assert found["seed 0 decimal"] in f"seed={2**100 + 12345}".encode()


def test_the_noise_state_cannot_be_pickled():
    import pickle

    from hf_dp.step.bandmf.noise import CorrelatedNoiseSource
    from hf_dp.step.bandmf.strategy import optimize_banded_toeplitz

    source = CorrelatedNoiseSource(NoiseSource(1), optimize_banded_toeplitz(10, 3))
    source.normal(step=0, shapes=[(4,)], std=1.0, device="cpu", dtype=torch.float32)
    with pytest.raises(TypeError):
        pickle.dumps(source)
