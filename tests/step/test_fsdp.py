"""DPTrainer under FSDP2 (``fsdp_config={"version": 2}``, torch's ``fully_shard``): 2 CPU processes with gloo.

accelerate enables FSDP only on accelerator device types; on CPU it silently trains with DDP instead. These tests
let accelerate's state take the FSDP plugin on ``MULTI_CPU`` too (:func:`allow_fsdp_on_cpu`, nothing else changes),
so that the Trainer runs its own FSDP2 path: accelerate's ``fsdp2_prepare_model`` and ``fully_shard`` on gloo.
"""

import contextlib
import json
import math
import os
import time

import pytest
import torch
from helpers.distributed import allow_fsdp_on_cpu, full_state, launch_two, reset_accelerate_state
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args, pad_collate

N = 16


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
    dynamic_padding=False,
    fail_self_check=False,
    stop_at=None,
    resume=False,
    **overrides,
):
    """Train a seeded tiny GPT-2; the main process saves the whole weights, logs and epsilon to ``result_path``."""
    from transformers import TrainerCallback

    from hf_dp import DPTrainer
    from hf_dp.engine import SelfCheckError
    from hf_dp.sampling.collators import is_empty_batch

    allow_fsdp_on_cpu()
    reset_accelerate_state()
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
    dataset, collator = (ToyDataset(N, trim=True), pad_collate) if dynamic_padding else (ToyDataset(N), collate)
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    trainer.add_callback(Stop())
    empty = torch.zeros(1)
    step = trainer.training_step

    def counting_step(model, inputs, *rest):
        empty.add_(float(is_empty_batch(inputs)))
        return step(model, inputs, *rest)

    trainer.training_step = counting_step
    if fail_self_check and torch.distributed.get_rank() == 1:

        def failing_self_check(inputs):
            raise SelfCheckError("injected on rank 1")

        trainer._self_check = failing_self_check
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    except Exception as error:  # what each process raised, for the test to read
        rank = torch.distributed.get_rank()
        with open(f"{result_path}.rank{rank}", "w") as f:
            f.write(f"{type(error).__name__}: {error}")
        if rank == 1:  # the launcher stops the other process once one failed: let process 0 write what it raised
            time.sleep(3)
        raise
    after = full_state(trainer.model)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(empty)
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
                "empty_micro_batches": int(empty.item()),
            },
            result_path,
        )


def _launch(*args, **kwargs):
    launch_two(_run, *args, **kwargs)


class TestFSDP2:
    @pytest.mark.parametrize(
        ("dynamic_padding", "style"), [(False, "all-layer"), (True, "all-layer"), (True, "layer-wise")]
    )
    def test_two_sharded_processes_match_one(self, tmp_path, single_process, dynamic_padding, style):
        """sigma = 0, q = 1: two processes with sharded parameters take the 1-process (unsharded) steps; with
        dynamic padding every micro-batch has its own length; layer-wise clipping delivers inside the backward pass
        (reduce-scatters in backward order)."""
        two = tmp_path / "two.pt"
        extra = {"dynamic_padding": dynamic_padding, "clipping_style": style}
        _launch(str(tmp_path / "fsdp"), str(two), 0.0, 3, 4, 2, **extra)
        one = tmp_path / "one.pt"
        _run(str(tmp_path / "single"), str(one), 0.0, 3, 8, 2, fsdp=False, **extra)
        r2, r1 = torch.load(two, weights_only=False), torch.load(one, weights_only=False)
        assert r2["is_fsdp"] and r2["sharded"] == "DTensor" and r2["world_size"] == 2
        for name in r1["after"]:
            torch.testing.assert_close(r2["after"][name], r1["after"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert any(not torch.equal(r1["after"][k], r1["before"][k]) for k in r1["after"])
        assert r2["epsilon"] == r1["epsilon"]

    def test_bf16_parameters_close_to_fp32(self, tmp_path, single_process):
        """bf16 (FSDP2 all-gathers bf16 parameters, MixedPrecisionPolicy): the two steps are those of fp32 up to bf16
        rounding (a parameter left out or counted twice would be off by its whole update)."""
        two, one = tmp_path / "bf16.pt", tmp_path / "one.pt"
        _launch(str(tmp_path / "a"), str(two), 0.0, 2, 4, 2, bf16=True)
        _run(str(tmp_path / "b"), str(one), 0.0, 2, 8, 2, fsdp=False)
        r2, r1 = torch.load(two, weights_only=False), torch.load(one, weights_only=False)
        assert r2["is_fsdp"]
        for name in r1["after"]:
            update = r1["after"][name] - r1["before"][name]
            if update.abs().max() == 0:  # the causal mask buffer
                continue
            error = (r2["after"][name] - r1["after"][name]).abs().max() / update.abs().max()
            assert error < 0.05, (name, float(error))

    def test_empty_micro_batches_match_data_parallel(self, tmp_path, single_process):
        """q < 1 with micro-batches of about one example: a process whose micro-batch is empty runs the placeholder
        with loss weight 0 (FSDP2 needs every process in every forward); the steps equal those of DDP, which skips
        it."""
        sharded, ddp = tmp_path / "fsdp.pt", tmp_path / "ddp.pt"
        _launch(str(tmp_path / "a"), str(sharded), 0.0, 3, 1, 4)
        _launch(str(tmp_path / "b"), str(ddp), 0.0, 3, 1, 4, fsdp=False)
        rs, rd = torch.load(sharded, weights_only=False), torch.load(ddp, weights_only=False)
        assert rs["is_fsdp"] and not rd["is_fsdp"]
        assert rs["empty_micro_batches"] == rd["empty_micro_batches"] > 0
        for name in rd["after"]:
            torch.testing.assert_close(rs["after"][name], rd["after"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert any(not torch.equal(rd["after"][k], rd["before"][k]) for k in rd["after"])

    def test_a_failed_self_check_on_one_process_stops_both(self, tmp_path, single_process):
        """The self-check fails on process 1 only: both processes raise before the backward pass (process 0 with a
        pointer to the other's error) instead of process 0 waiting in its next collective."""
        from torch.multiprocessing import ProcessRaisedException

        result = tmp_path / "a.pt"
        with pytest.raises(ProcessRaisedException):
            _launch(str(tmp_path / "a"), str(result), 0.0, 1, 4, 2, fail_self_check=True)
        assert "injected on rank 1" in (tmp_path / "a.pt.rank1").read_text()
        assert "another process failed" in (tmp_path / "a.pt.rank0").read_text()

    @pytest.mark.parametrize(("per_device", "accumulation"), [(4, 2), (8, 1)])
    def test_noise_added_once_per_coordinate(self, tmp_path, single_process, per_device, accumulation):
        """Also when the step's last micro-batch is the collective-free first one (accumulation 1), where the model
        holds its unsharded parameters while the noise is added."""
        sigma, clip = 2.0, 0.5
        clean, noisy = tmp_path / "clean.pt", tmp_path / "noisy.pt"
        _launch(str(tmp_path / "a"), str(clean), 0.0, 1, per_device, accumulation)
        _launch(str(tmp_path / "b"), str(noisy), sigma, 1, per_device, accumulation)
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
        # what the sharded checkpoint holds: the weights in torch.distributed.checkpoint's format, and a trainer state
        # that passed the release filter (epsilon logged, no training loss)
        checkpoint = tmp_path / "full" / "checkpoint-4"
        assert any(path.name.startswith("pytorch_model_fsdp") for path in checkpoint.iterdir())
        history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
        assert any("epsilon" in h for h in history)
        assert not any(key in h for h in history for key in ("loss", "train_loss"))
        from hf_dp.accounting import epsilon

        assert [h["epsilon"] for h in rf["logs"]] == pytest.approx(
            [epsilon(1.0, 0.5, s, 1 / (2 * N)) for s in (1, 2, 3, 4)]
        )
        # a fixed noise_seed (tests only) derives step s's noise from (seed, s, process): the resumed run takes the
        # same steps as the uninterrupted one
        for name in rf["after"]:
            torch.testing.assert_close(rp["after"][name], rf["after"][name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------------- engine level
# (model, batches, class of the blocks to shard, mode, clipping style, clipping function)
ENGINE_CASES = [
    ("gpt2", "causal", "GPT2Block", "bk-mixopt", "all-layer", "abadi"),
    ("gpt2", "causal", "GPT2Block", "bk", "all-layer", "abadi"),
    ("gpt2", "causal", "GPT2Block", "per-sample", "all-layer", "abadi"),
    ("gpt2", "causal", "GPT2Block", "bk-mixopt", "layer-wise", "abadi"),
    ("gpt2", "causal", "GPT2Block", "bk", "param-wise", "automatic"),
    ("gpt2_untied", "causal", "GPT2Block", "bk-mixopt", "all-layer", "abadi"),
    ("gpt2_b_eq_t", "causal_b_eq_t", "GPT2Block", "bk", "all-layer", "abadi"),
    ("gpt2_lora", "causal", "GPT2Block", "bk-mixopt", "all-layer", "abadi"),
    ("llama", "causal", "LlamaDecoderLayer", "bk-mixopt", "all-layer", "abadi"),
    ("llama", "causal", "LlamaDecoderLayer", "bk", "layer-wise", "abadi"),
    ("bert_classifier", "classification", "BertLayer", "bk-mixopt", "all-layer", "abadi"),
]


def _engine_case(case, rank, world):
    """Worst relative error between the sharded clipped sums (2 micro-batches: the first with the whole model on
    every process, the second sharded as in training, where process 1 runs a weight-0 placeholder) and one process's
    clipped sums of the same examples."""
    import copy

    from helpers import models
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_dp.engine import BookKeepingClipper
    from hf_dp.step.fsdp import FSDP2Clipping

    name, data, block, mode, style, fn = case
    builders = {
        "gpt2": models.gpt2,
        "gpt2_b_eq_t": models.gpt2,
        "gpt2_untied": lambda: models.gpt2(tied=False),
        "gpt2_lora": models.gpt2_lora,
        "llama": models.llama,
        "bert_classifier": models.bert_classifier,
    }
    batches = {
        "causal": models.causal_batches,
        "causal_b_eq_t": lambda: models.causal_batches(shapes=models.B_EQ_T),
        "classification": models.classification_batches,
    }[data]()
    loss_fn = models.classification_loss if data == "classification" else models.causal_loss
    torch.manual_seed(0)
    model = builders[name]()
    reference = copy.deepcopy(model)
    kwargs = dict(max_grad_norm=0.5, mode=mode, clipping_style=style, clipping_fn=fn)
    ref = BookKeepingClipper(reference, **kwargs)
    for batch in batches:
        ref.backward(loss_fn(reference, batch))
    ref.remove()

    mesh = init_device_mesh("cpu", (world,))
    for module in model.modules():
        if type(module).__name__ == block:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = FSDP2Clipping(model, clipped_in_backward=style != "all-layer")
    sharded.start()
    with sharded.collective_free():
        clipper = BookKeepingClipper(
            model, **kwargs, grad_sink=sharded.sink, registered_parameters=sharded.registered_parameters()
        )
    for step, batch in enumerate(batches):
        weight = 1.0
        if step == 0:
            local = {k: v[rank::world] for k, v in batch.items()}
        elif rank == 0:
            local = batch
        else:  # an empty micro-batch: the placeholder example, loss weight 0
            local, weight = {k: v[:1] for k, v in batch.items()}, 0.0
        block_ctx = sharded.collective_free() if step == 0 else contextlib.nullcontext()
        with block_ctx:
            clipper.allow_own_passes = step == 0
            loss = loss_fn(model, local) * weight
            clipper.prepare(loss, loss_scale=1.0)
            loss.sum().backward()
            clipper.finish()
            sharded.flush()
    clipper.remove()
    worst = 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if not q.requires_grad:
            assert p.grad is None, n
            continue
        # error relative to the parameter's gradient, floored at 1e-3 (a gradient that is zero in exact arithmetic,
        # like BERT's key bias under softmax, is float32 rounding noise in both)
        scale = max(float(q.grad.abs().max()), 1e-3)
        worst = max(worst, float((p.grad.full_tensor() - q.grad).abs().max()) / scale)
    return worst


def _hsdp_refused(world) -> float:
    """0 if FSDP2Clipping refuses a model sharded on a 2-D (replicate x shard) mesh, else 1."""
    from helpers import models
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_dp.step.fsdp import FSDP2Clipping

    model = models.gpt2()
    fully_shard(model, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")))
    try:
        FSDP2Clipping(model)
    except ValueError as error:
        return 0.0 if "HSDP" in str(error) else 1.0
    return 1.0


def _engine_job(rank, world, port, result_path):
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # this module and tests/ (helpers)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        errors = {"-".join(case): _engine_case(case, rank, world) for case in ENGINE_CASES}
        errors["hsdp-refused"] = _hsdp_refused(world)
        if rank == 0:
            torch.save(errors, result_path)
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def test_engine_sharded_clipped_sums_match_one_process(tmp_path):
    """BookKeepingClipper on a fully_shard model (2 gloo processes): the reduce-scattered clipped sums equal one
    process's on the same examples, for every mode, clipping style and function, tied and untied heads, LoRA,
    micro-batch == sequence length, and a process whose micro-batch is a weight-0 placeholder."""
    import socket

    from torch.multiprocessing import start_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = tmp_path / "errors.pt"
    start_processes(_engine_job, args=(2, port, str(result)), nprocs=2, start_method="spawn")
    errors = torch.load(result)
    assert len(errors) == len(ENGINE_CASES) + 1
    bad = {case: err for case, err in errors.items() if not err < 1e-5}
    assert not bad, bad


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"fsdp_config": {"version": 1}}, "FSDP2 only"),
        ({"fsdp_config": {"version": 2, "cpu_offload": True}}, "offloading"),
        ({"fsdp_config": {"version": 2, "activation_checkpointing": True}}, "activation checkpointing"),
        ({"fsdp_config": {"version": 2}, "gradient_checkpointing": True}, "activation checkpointing"),
    ],
)
def test_unsupported_fsdp_settings_are_refused(tmp_path, single_process, overrides, match):
    from hf_dp import DPTrainer

    args = dp_args(str(tmp_path), fsdp=True, **overrides)
    with pytest.raises(ValueError, match=match):
        DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(N), data_collator=collate)


def test_deepspeed_is_refused_with_fsdp2_pointer(tmp_path, single_process):
    from hf_dp.plan.checks import check_before_init

    args = dp_args(str(tmp_path))
    args.deepspeed = {"zero_optimization": {"stage": 2}}  # set after init: building the DeepSpeed plugin needs it
    with pytest.raises(ValueError, match="FSDP2"):
        check_before_init(gpt2(), args, ToyDataset(N), None)
