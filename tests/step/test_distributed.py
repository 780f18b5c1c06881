"""DPTrainer under data parallelism: 2 CPU processes (gloo) through accelerate's debug_launcher."""

import math
import os

import pytest
import torch
from helpers.distributed import launch_two, reset_accelerate_state
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args

N = 16


def _run(out_dir, result_path, sigma, max_steps, per_device, accumulation, *, stop_at=None, resume=False):
    """Train a seeded tiny GPT-2; the main process saves weights, logs and epsilon to ``result_path``."""
    from transformers import TrainerCallback

    from hf_dp import DPTrainer

    reset_accelerate_state()
    torch.manual_seed(0)
    model = gpt2()
    args = dp_args(
        out_dir,
        noise_multiplier=sigma,
        per_sample_max_grad_norm=0.5,
        max_steps=max_steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        **({"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}),
        save_strategy="steps",
        save_steps=2,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ToyDataset(N), data_collator=collate)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    trainer.add_callback(Stop())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train(resume_from_checkpoint=True if resume else None)
    if trainer.is_world_process_zero():
        torch.save(
            {
                "before": before,
                "after": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "epsilon": trainer.epsilon(),
                "logs": [h for h in trainer.state.log_history if "loss" in h],
                "world_size": trainer.args.world_size,
                "steps": trainer.dp_callback.steps,
                "expected_batch_size": trainer.expected_batch_size,
            },
            result_path,
        )


def _launch(*args, **kwargs):
    launch_two(_run, *args, **kwargs)


class TestDataParallel:
    def test_two_processes_match_one(self, tmp_path, single_process):
        """sigma = 0, q = 1: the 2-process update equals the 1-process one."""
        two = tmp_path / "two.pt"
        _launch(str(tmp_path / "ddp"), str(two), 0.0, 2, 4, 2)
        one = tmp_path / "one.pt"
        reset_accelerate_state()
        _run(str(tmp_path / "single"), str(one), 0.0, 2, 8, 2)
        r2, r1 = torch.load(two), torch.load(one)
        assert r2["world_size"] == 2 and r1["world_size"] == 1
        assert r2["expected_batch_size"] == r1["expected_batch_size"] == N
        for name in r1["after"]:
            torch.testing.assert_close(r2["after"][name], r1["after"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert any(not torch.equal(r1["after"][k], r1["before"][k]) for k in r1["after"])

    def test_noise_added_once(self, tmp_path, single_process):
        sigma, clip = 2.0, 0.5
        clean, noisy = tmp_path / "clean.pt", tmp_path / "noisy.pt"
        _launch(str(tmp_path / "a"), str(clean), 0.0, 1, 4, 2)
        _launch(str(tmp_path / "b"), str(noisy), sigma, 1, 4, 2)
        rc, rn = torch.load(clean), torch.load(noisy)
        noise = torch.cat([(rn["after"][k] - rc["after"][k]).flatten() for k in rc["after"] if "attn.bias" not in k])
        model = gpt2()
        num_params = sum(p.numel() for p in model.parameters())
        expected = 0.5 * sigma * clip * math.sqrt(num_params) / N  # lr * sigma * C * sqrt(P) / L
        # noise drawn on every rank would give sqrt(2) x this; none would give ~0
        assert float(noise.norm()) == pytest.approx(expected, rel=0.1)

    def test_resume_continues_epsilon(self, tmp_path, single_process):
        full, part = tmp_path / "full.pt", tmp_path / "part.pt"
        _launch(str(tmp_path / "full"), str(full), 1.0, 4, 2, 2)
        _launch(str(tmp_path / "part"), str(part), 1.0, 4, 2, 2, stop_at=2)
        assert torch.load(part)["steps"] == 2
        _launch(str(tmp_path / "part"), str(part), 1.0, 4, 2, 2, resume=True)
        rf, rp = torch.load(full), torch.load(part)
        assert rp["steps"] == 4
        assert rp["epsilon"] == pytest.approx(rf["epsilon"], rel=1e-12)
        # the same as a single process with the same q = (2 x 2 x 2) / 16 and steps
        from hf_dp.accounting import epsilon

        assert [h["epsilon"] for h in rf["logs"]] == pytest.approx(
            [epsilon(1.0, 0.5, s, 1 / (2 * N)) for s in (1, 2, 3, 4)]
        )
        for name in rf["after"]:
            torch.testing.assert_close(rp["after"][name], rf["after"][name], rtol=1e-5, atol=1e-6, msg=name)
