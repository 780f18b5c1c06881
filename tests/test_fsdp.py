"""DPTrainer under FSDP2 (``fsdp_config={"version": 2}``, torch's ``fully_shard``): 2 CPU processes with gloo.

accelerate enables FSDP only on accelerator device types; on CPU it silently trains with DDP instead. These tests
let accelerate's state take the FSDP plugin on ``MULTI_CPU`` too (:func:`_allow_fsdp_on_cpu`, nothing else changes),
so that the Trainer runs its own FSDP2 path: accelerate's ``fsdp2_prepare_model`` and ``fully_shard`` on gloo.
"""

import math
import os

import pytest
import torch
from models import gpt2
from test_distributed import _reset_accelerate_state
from test_trainer import ToyDataset, collate, dp_args

N = 16


def _allow_fsdp_on_cpu():
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_hf_dp_patched", False):
        return

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    init._hf_dp_patched = True
    AcceleratorState.__init__ = init


def _full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (all-gathered from the shards: every process must call it)."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def _run(
    out_dir,
    result_path,
    sigma,
    max_steps,
    per_device,
    accumulation,
    *,
    fsdp=True,
    saves=False,
    stop_at=None,
    resume=False,
    **overrides,
):
    """Train a seeded tiny GPT-2; the main process saves the whole weights, logs and epsilon to ``result_path``."""
    from transformers import TrainerCallback

    from hf_dp import DPTrainer

    _allow_fsdp_on_cpu()
    _reset_accelerate_state()
    torch.manual_seed(0)
    # tied=False in runs that save checkpoints: transformers' save_pretrained cannot find the tied tensors of a model
    # whose tied table (vocabulary 23) is sharded unevenly (a plain Trainer fails the same way)
    model = gpt2(tied=not saves)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharding = {}
    if fsdp:
        config = {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}
        if saves:  # checkpoints in torch.distributed.checkpoint's sharded format
            config["state_dict_type"] = "SHARDED_STATE_DICT"
        sharding = {"fsdp": True, "fsdp_config": config}
    args = dp_args(
        out_dir,
        noise_multiplier=sigma,
        per_sample_max_grad_norm=0.5,
        max_steps=max_steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        **({"ddp_backend": "gloo"} if world > 1 else {}),
        save_strategy="steps" if saves else "no",
        save_steps=2,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        **sharding,
        **overrides,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ToyDataset(N), data_collator=collate)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    trainer.add_callback(Stop())
    trainer.train(resume_from_checkpoint=True if resume else None)
    after = _full_state(trainer.model)
    if trainer.is_world_process_zero():
        torch.save(
            {
                "before": before,
                "after": after,
                "epsilon": trainer.epsilon(),
                "logs": [h for h in trainer.state.log_history if "loss" in h],
                "world_size": trainer.args.world_size,
                "steps": trainer.dp_callback.steps,
                "is_fsdp": trainer.is_fsdp_enabled,
                "sharded": type(next(trainer.model.parameters())).__name__,
            },
            result_path,
        )


def _launch(*args, **kwargs):
    """Two spawned processes with accelerate's debug-launcher environment (as in test_distributed)."""
    import socket
    import tempfile

    from accelerate.utils import PrepareForLaunch, patch_environment
    from torch.multiprocessing import start_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (
        tempfile.TemporaryDirectory() as rdv,
        patch_environment(
            world_size=2,
            master_addr="127.0.0.1",
            master_port=str(port),
            accelerate_mixed_precision="no",
            accelerate_debug_rdv_file=os.path.join(rdv, "rdv"),
            accelerate_use_cpu="yes",
            gloo_socket_ifname="lo",
        ),
    ):
        start_processes(PrepareForLaunch(_Job(args, kwargs), debug=True), nprocs=2, start_method="spawn")


class _Job:
    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs

    def __call__(self):
        _run(*self.args, **self.kwargs)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


@pytest.fixture
def single_process():
    _reset_accelerate_state()
    yield
    _reset_accelerate_state()


class TestFSDP2:
    def test_two_sharded_processes_match_one(self, tmp_path, single_process):
        """sigma = 0, q = 1: two processes with sharded parameters take the 1-process (unsharded) steps."""
        two = tmp_path / "two.pt"
        _launch(str(tmp_path / "fsdp"), str(two), 0.0, 2, 4, 2)
        one = tmp_path / "one.pt"
        _run(str(tmp_path / "single"), str(one), 0.0, 2, 8, 2, fsdp=False)
        r2, r1 = torch.load(two, weights_only=False), torch.load(one, weights_only=False)
        assert r2["is_fsdp"] and r2["sharded"] == "DTensor" and r2["world_size"] == 2
        for name in r1["after"]:
            torch.testing.assert_close(r2["after"][name], r1["after"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert any(not torch.equal(r1["after"][k], r1["before"][k]) for k in r1["after"])
        assert r2["epsilon"] == r1["epsilon"]

    def test_noise_added_once_per_coordinate(self, tmp_path, single_process):
        sigma, clip = 2.0, 0.5
        clean, noisy = tmp_path / "clean.pt", tmp_path / "noisy.pt"
        _launch(str(tmp_path / "a"), str(clean), 0.0, 1, 4, 2)
        _launch(str(tmp_path / "b"), str(noisy), sigma, 1, 4, 2)
        rc, rn = torch.load(clean, weights_only=False), torch.load(noisy, weights_only=False)
        keys = [k for k in rc["after"] if "attn.bias" not in k and k != "lm_head.weight"]  # lm_head is tied to wte
        noise = torch.cat([(rn["after"][k] - rc["after"][k]).flatten() for k in keys])
        num_params = sum(p.numel() for p in gpt2().parameters())
        expected = 0.5 * sigma * clip * math.sqrt(num_params) / N  # lr * sigma * C * sqrt(P) / L
        # noise on both shards of a coordinate would give sqrt(2) x this, on none ~0
        assert float(noise.norm()) == pytest.approx(expected, rel=0.1)
        # the two shards of each parameter carry independent noise (no shared stream)
        wte = rn["after"]["transformer.wte.weight"] - rc["after"]["transformer.wte.weight"]
        half = wte.shape[0] // 2
        assert not torch.allclose(wte[:half], wte[half : 2 * half])

    def test_resume_continues_epsilon(self, tmp_path, single_process):
        full, part = tmp_path / "full.pt", tmp_path / "part.pt"
        _launch(str(tmp_path / "full"), str(full), 1.0, 4, 2, 2, saves=True)
        _launch(str(tmp_path / "part"), str(part), 1.0, 4, 2, 2, saves=True, stop_at=2)
        assert torch.load(part, weights_only=False)["steps"] == 2
        _launch(str(tmp_path / "part"), str(part), 1.0, 4, 2, 2, saves=True, resume=True)
        rf, rp = torch.load(full, weights_only=False), torch.load(part, weights_only=False)
        assert rp["steps"] == 4
        assert rp["epsilon"] == pytest.approx(rf["epsilon"], rel=1e-12)
        from hf_dp.accounting import epsilon

        assert [h["epsilon"] for h in rf["logs"]] == pytest.approx(
            [epsilon(1.0, 0.5, s, 1 / (2 * N)) for s in (1, 2, 3, 4)]
        )
        # a fixed noise_seed (tests only) derives step s's noise from (seed, s, process): the resumed run takes the
        # same steps as the uninterrupted one
        for name in rf["after"]:
            torch.testing.assert_close(rp["after"][name], rf["after"][name], rtol=1e-5, atol=1e-6, msg=name)
