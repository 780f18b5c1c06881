"""Banded correlated noise under DDP (issue 41): 2 CPU processes (gloo) train exactly as one process with the same
seeds and expected batch: the main process alone adds row t of C^-1 Z (its noise state only there), the all-reduce
sums it once, and the cyclic Poisson batches' shares add up to the one-process batches."""

import os

import torch
from helpers.distributed import launch_two, reset_accelerate_state
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args

N = 32


def _run(out_dir, result_path, per_device):
    from hf_dp import DPTrainer

    reset_accelerate_state()
    torch.manual_seed(0)
    model = gpt2()
    args = dp_args(
        out_dir,
        noise_multiplier=1.0,
        per_sample_max_grad_norm=0.5,
        max_steps=5,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=2,
        **({"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}),
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        noise_mechanism="banded-toeplitz",
        noise_bands=2,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=ToyDataset(N), data_collator=collate)
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save(
            {
                "after": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "epsilon": trainer.epsilon(),
                "world_size": trainer.args.world_size,
                "history": trainer.dp_callback.history,
            },
            result_path,
        )


def test_two_processes_match_one_with_banded_noise(tmp_path, single_process):
    two, one = tmp_path / "two.pt", tmp_path / "one.pt"
    launch_two(_run, str(tmp_path / "ddp"), str(two), 2)  # L = 2 x 2 x 2 = 8
    reset_accelerate_state()
    _run(str(tmp_path / "single"), str(one), 4)  # L = 4 x 2 = 8
    r2, r1 = torch.load(two), torch.load(one)
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    assert r2["history"] == r1["history"] == [[1.0, 0.5, 5]]  # q_part = 2 x 8 / 32
    assert r2["epsilon"] == r1["epsilon"]
    for name in r1["after"]:
        torch.testing.assert_close(r2["after"][name], r1["after"][name], rtol=1e-5, atol=1e-6, msg=name)
