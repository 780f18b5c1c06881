"""User-level DP under data parallelism (DDP) and FSDP2: 2 CPU processes (gloo), against a float64 per-row autograd
oracle.

Each rank takes whole users (``users[rank::2]``) and cuts them into its micro-batches; a micro-batch of a rank may be
empty while the other rank runs a backward pass: under DDP the rank skips it, under FSDP2 it runs a placeholder
example with loss weight 0 (the collectives are shared).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.distributed import allow_fsdp_on_cpu, full_state, launch_two, reset_accelerate_state
from helpers.models import gpt2
from helpers.oracle import clipped_unit_mean
from helpers.trainer import sgd_step_args
from helpers.user_level import AuthoredDataset, RecordingCollate, row_grads, user_args


def _run_users(
    out_dir: str,
    init_path: str,
    result_path: str,
    sizes: list[int],
    clip: float,
    per_device: int,
    accumulation: int,
    fsdp: bool,
):
    """One SGD step (lr 1, sigma 0, q 1) of user-level DPTrainer from the weights in ``init_path``; every rank saves
    the rows of its micro-batches and the kind of each (a batch, empty, or FSDP2's placeholder), the main process the
    weights after it."""
    from hf_dp import DPTrainer
    from hf_dp.sampling.collators import PLACEHOLDER_KEY, is_empty_batch

    allow_fsdp_on_cpu()
    reset_accelerate_state()
    torch.set_default_dtype(torch.float64)
    model = gpt2().double()
    model.load_state_dict(torch.load(init_path))
    dataset = AuthoredDataset(sizes)
    collate = RecordingCollate()
    args = sgd_step_args(
        out_dir,
        per_sample_max_grad_norm=clip,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        **({"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}),
        **user_args(out_dir, max_examples_per_user=max(sizes)),
        **(
            {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
            if fsdp
            else {}
        ),
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    kinds = []
    step = trainer.training_step

    def recording_step(model, inputs, *rest):
        kinds.append("placeholder" if PLACEHOLDER_KEY in inputs else "empty" if is_empty_batch(inputs) else "")
        return step(model, inputs, *rest)

    trainer.training_step = recording_step
    trainer.train()
    after = full_state(trainer.model)  # every process takes part in the all-gather of the shards
    rank = trainer.args.process_index
    torch.save(
        {
            "batches": collate.batches,
            "kinds": kinds,
            "world_size": trainer.args.world_size,
            "is_fsdp": trainer.is_fsdp_enabled,
            "sample_rate": trainer.sample_rate,
            "units": trainer.num_train_examples,
            "after": after if rank == 0 else None,
        },
        f"{result_path}.{rank}",
    )


@pytest.mark.parametrize(
    ("sizes", "per_device", "accumulation", "empty", "fsdp"),
    [
        ([1, 2, 5, 2, 3, 1, 2, 4], 2, 2, 0, False),  # DDP: four users per rank, two micro-batches each
        ([9, 1, 1, 1, 1, 1, 1, 1], 1, 4, 1, False),  # DDP: a large user, one micro-batch of one rank empty
        ([9, 1, 1, 1, 1, 1, 1, 1], 1, 4, 1, True),  # FSDP2: the empty one runs as the placeholder
    ],
    ids=["ddp", "ddp-empty", "fsdp2-empty"],
)
def test_two_processes_step_is_the_mean_of_clipped_user_sums(
    tmp_path,
    single_process,  # noqa: F811
    float64,
    sizes,
    per_device,
    accumulation,
    empty,
    fsdp,
):
    """sigma = 0, q = 1, SGD lr 1, one step on 2 processes: every user lies whole in one micro-batch of one rank, the
    ranks together hold every row once, and the update is -(1/U) sum_u clip(sum_{i in u} g_i) against per-row
    autograd in float64 (C: the median user norm, so that some users are clipped and some not)."""
    torch.manual_seed(0)
    model = gpt2().double()
    init = tmp_path / "init.pt"
    torch.save(model.state_dict(), init)
    dataset = AuthoredDataset(sizes)
    grads = row_grads(model, dataset, range(len(dataset)))
    expected, clip, _ = clipped_unit_mean([grads[i] for i in range(len(dataset))], dataset.authors)
    by_user: dict[str, list[int]] = {}
    for i, author in enumerate(dataset.authors):
        by_user.setdefault(author, []).append(i)

    result = tmp_path / "result.pt"
    launch_two(_run_users, str(tmp_path / "out"), str(init), str(result), sizes, clip, per_device, accumulation, fsdp)
    ranks = [torch.load(f"{result}.{r}") for r in (0, 1)]
    assert all(r["world_size"] == 2 and r["sample_rate"] == 1.0 and r["units"] == len(by_user) for r in ranks)
    assert all(r["is_fsdp"] == fsdp for r in ranks)

    # the non-empty micro-batches of the step: under DDP the collator never sees an empty one; under FSDP2 every
    # micro-batch runs, an empty one as the placeholder (the collator's call for it is left out here)
    for r in ranks:
        assert len(r["kinds"]) == accumulation  # every micro-batch reaches the training step
        assert set(r["kinds"]) <= ({"", "placeholder"} if fsdp else {"", "empty"})
    collated = [zip(r["batches"], [k for k in r["kinds"] if k != "empty"], strict=True) for r in ranks]
    step = [b for pairs in collated for b, kind in pairs if kind == ""]
    assert sorted(i for b in step for i in b) == list(range(len(dataset)))
    for rows in by_user.values():
        holding = [b for b in step if set(rows) & set(b)]
        assert len(holding) == 1 and set(rows) <= set(holding[0])
    assert 2 * accumulation - len(step) == empty  # and the other rank's backward pass went on without a deadlock

    after = ranks[0]["after"]
    for (name, p), e in zip(model.named_parameters(), expected, strict=True):
        torch.testing.assert_close(after[name] - p.detach(), -e, rtol=1e-6, atol=1e-12, msg=name)
