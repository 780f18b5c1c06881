"""GPU check: speed, peak memory and largest batch of non-private vs hf_dp vs Opacus, and fp16/bf16 exactness.

One command for one GPU, under 8 minutes by default (issue 19, item 7). A benchmark, not a test: one tab-separated
``key=value`` line per measurement, side by side in one run, then a table of ratios to non-private and the machine.

    python benchmarks/gpu_check.py                              # cuda: GPT-2 small and medium, T=128, B=16, all parts
    python benchmarks/gpu_check.py --out gpu_check.json         # also a JSON of every measurement
    python benchmarks/gpu_check.py --parts speed --models small --batch 32 --seq 256
    python benchmarks/gpu_check.py --parts maxbatch --maxbatch-models small medium --maxbatch-budget-s 400
    python benchmarks/gpu_check.py --device cpu --tiny          # smoke test on CPU (tests/benchmarks/test_gpu_check.py)

Parts, run in this order, each within its own time budget (and all within ``--budget-s``): a measurement that fails
prints its error and the run goes on; what a spent budget leaves out is printed as ``status=skipped``.

- ``speed``: GPT-2 small (12 x 768) and medium (24 x 1024), vocab 50257, built from configs (random init, dropout
  off). One step = forward, per-example loss (``causal_lm_loss``, token mean per example, ``[B]``), backward, AdamW
  step. Variants: ``non-private`` (``loss.sum().backward()``); ``hf_dp-bk-mixopt`` (``BookKeepingClipper(model,
  max_grad_norm=1.0, mode="bk-mixopt")``, ``clipper.backward(loss)``); ``hf_dp-layer-wise`` (the same with
  ``clipping_style="layer-wise"``, skipped when the engine does not take that keyword); ``opacus``
  (``PrivacyEngine.make_private``, default hooks, noise 0); ``opacus-ghost`` (``grad_sample_mode="ghost"``; Opacus
  1.6 refuses tied parameters there, so it runs with an untied ``lm_head`` and says so with ``tied=False``). Median
  step time of ``--repeats`` steps after ``--warmup`` steps (the first step, which for hf_dp also proves its plan,
  is reported apart), tokens/s, and peak memory of the steady steps (``torch.cuda.max_memory_allocated``, reset
  after the warm-up; ``peak_first_mb`` includes the warm-up); ``ops`` and ``syncs``: the aten ops and host syncs of
  one more steady step, counted on the device (to confirm the CPU counts of ``benchmarks/overhead.py``).
- ``precision``: ``DPTrainer`` for ``--precision-steps`` steps at ``noise_multiplier=0`` (SGD, lr 1, C = 1, the
  same seed, Poisson batches and random token ids) in fp32 and in fp16 / bf16 (autocast); the relative difference of
  the parameter update ``||d_amp - d_fp32|| / ||d_fp32||`` (all parameters, and the worst tensor), and for fp16 the
  loss scale: start, end, back-offs, and the noised counts of dropped (overflowed) examples the policy saw
  (``trainer.dp_step.loss_scaling.policy``; with sigma = 0 they equal the raw counts).
- ``maxbatch``: the largest batch per variant for which a fresh model runs two steps (first and steady): doubling
  from ``--batch``, then bisection to ``--resolution``, on ``torch.cuda.OutOfMemoryError``; bounded by
  ``--max-batch-cap`` and the part's budget, by default what the run has left, shared by the searches still to run
  (a search cut short prints ``max_batch>=``).

Every measurement runs in its own process, forked from this one after the imports and before CUDA is initialised
(so no process pays the imports again): its peak memory is its own, and a crash, hang or OOM stays in it. On CPU
the memory is the process's peak RSS above its RSS before the model was built. ``--tiny`` (for ``--device cpu``):
tiny models, B=2, T=16, one repeat, no largest-batch search and no fp16 unless asked (``--parts``,
``--precisions fp16``: fp16 on CPU uses torch's CPU GradScaler, as tests/test_fp16.py does).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

VARIANTS = ["non-private", "hf_dp-bk-mixopt", "hf_dp-layer-wise", "opacus", "opacus-ghost"]
PARTS = ["speed", "precision", "maxbatch"]
PRECISIONS = ["fp16", "bf16"]
#: GPT-2 shapes (n_layer, n_embd, n_head, vocab_size, n_positions): the real ones, and the --tiny ones.
MODELS = {"small": (12, 768, 12, 50257, 1024), "medium": (24, 1024, 16, 50257, 1024)}
TINY_MODELS = {"small": (2, 32, 2, 256, 64), "medium": (3, 48, 4, 256, 64)}
#: (total, speed, precision) default budgets in seconds; `maxbatch`, last, gets what the run has left by default.
BUDGETS = {"full": (460, 200, 90), "tiny": (600, 240, 180)}


class Skip(Exception):
    """A measurement that does not apply here (its reason is printed with ``status=skipped``)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny models, B=2, T=16, 1 repeat: a smoke test (for cpu)")
    p.add_argument("--parts", nargs="+", choices=PARTS, help="parts to run (default: all; --tiny: no maxbatch)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="models of `speed`")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS, help="variants (speed, maxbatch)")
    p.add_argument("--seq", type=int, help="sequence length T (default 128; --tiny: 16)")
    p.add_argument("--batch", type=int, help="batch size of `speed`, first size of `maxbatch` (default 16; --tiny: 2)")
    p.add_argument("--repeats", type=int, help="timed steps per variant (default 10; --tiny: 1)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 3; --tiny: 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype (speed, maxbatch)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (speed, maxbatch; default: off, torch's)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, help="vs fp32 in `precision` (--tiny: bf16)")
    p.add_argument("--precision-model", choices=list(MODELS), default="small", help="model of `precision`")
    p.add_argument("--precision-steps", type=int, default=3, help="DPTrainer steps of `precision`")
    p.add_argument("--maxbatch-models", nargs="+", choices=list(MODELS), default=["small"], help="models of maxbatch")
    p.add_argument("--max-batch-cap", type=int, default=8192, help="largest batch tried")
    p.add_argument("--resolution", type=float, default=0.05, help="bisection stops when (fail - fit) <= this x fit")
    p.add_argument("--budget-s", type=float, help="time budget of the whole run (default 460; --tiny: 600)")
    p.add_argument("--speed-budget-s", type=float, help="budget of `speed` (default 200)")
    p.add_argument("--precision-budget-s", type=float, help="budget of `precision` (default 90)")
    p.add_argument(
        "--maxbatch-budget-s", type=float, help="budget of `maxbatch`, shared by its searches (default: what is left)"
    )
    p.add_argument("--job-timeout-s", type=float, default=120, help="at most this long for one measurement")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each measurement (0: torch default)")
    p.add_argument("--logs", help="keep each measurement's stdout/stderr here (default: a temp dir, kept on failure)")
    p.add_argument("--out", help="write every measurement, the summary and the machine as JSON here")
    p.add_argument("--simulate-oom-above", type=int, default=0, help=argparse.SUPPRESS)  # tests: OOM above this batch
    args = p.parse_args(argv)
    tiny = args.tiny
    for name, full, small in [("seq", 128, 16), ("batch", 16, 2), ("repeats", 10, 1), ("warmup", 3, 1)]:
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    budgets = BUDGETS["tiny" if tiny else "full"]
    names = ["budget_s", "speed_budget_s", "precision_budget_s"]
    for name, value in zip(names, budgets, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, float(value))
    return args


# ---------------------------------------------------------------------------------------------- measurement side
# Everything below up to the orchestration runs in a forked child process, one per measurement.


def model_shape(args, name: str) -> tuple:
    return (TINY_MODELS if args.tiny else MODELS)[name]


def build_model(args, name: str, *, tied: bool = True, dtype=None):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head, vocab, n_positions = model_shape(args, name)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=max(n_positions, args.seq),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = GPT2LMHeadModel(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.train()
    return model


class PerExampleCausalLM:
    """Opacus criterion: ``[B]`` per-example losses when Opacus sets ``reduction="none"``, their sum otherwise."""

    reduction = "sum"

    def __call__(self, logits, labels):
        from hf_dp.losses import causal_lm_loss

        loss = causal_lm_loss(logits, labels, reduction="mean")
        return loss if self.reduction == "none" else loss.sum()


def make_step(args, variant: str, model, batch: int) -> Callable[[], None]:
    """One training step of ``variant`` on a fixed random batch of ``batch`` x ``args.seq`` tokens."""
    import torch

    from hf_dp import BookKeepingClipper
    from hf_dp.losses import causal_lm_loss

    device = torch.device(args.device)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, args.seq), device=device)
    # contiguous: Opacus' embedding norm sampler views its input ids
    position_ids = torch.arange(args.seq, device=device).repeat(batch, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clipper = criterion = None
    if variant == "hf_dp-bk-mixopt":
        clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk-mixopt")
    elif variant == "hf_dp-layer-wise":
        try:
            clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk-mixopt", clipping_style="layer-wise")
        except TypeError as e:
            raise Skip(f"layer-wise not available (BookKeepingClipper: {e})") from None
    elif variant in ("opacus", "opacus-ghost"):
        try:
            from opacus import PrivacyEngine
        except ImportError as e:
            raise Skip(f"opacus not installed ({e}); pip install opacus") from None
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids.cpu()), batch_size=batch)
        private = PrivacyEngine().make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            loss_reduction="sum",
            grad_sample_mode="ghost" if variant == "opacus-ghost" else "hooks",
            criterion=PerExampleCausalLM(),
        )
        model, optimizer = private[0], private[1]
        if variant == "opacus-ghost":
            criterion = private[2]
    elif variant != "non-private":
        raise ValueError(f"unknown variant {variant!r}")

    def step():
        logits = model(input_ids=ids, position_ids=position_ids).logits
        if args.simulate_oom_above and batch > args.simulate_oom_above:  # tests: the OOM path on a CPU
            raise torch.cuda.OutOfMemoryError(f"simulated: batch {batch} > {args.simulate_oom_above}")
        if criterion is not None:  # Opacus ghost: its loss wrapper runs both backward passes
            criterion(logits, ids).backward()
        else:
            loss = causal_lm_loss(logits, ids, reduction="mean")  # [B]
            if clipper is not None:
                clipper.backward(loss)
            else:
                loss.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def is_tying_refusal(error: BaseException) -> bool:
    return isinstance(error, NotImplementedError) and "tying" in str(error).lower()


class Memory:
    """Peak memory since the last ``reset()``: CUDA's allocator, or the process's peak RSS above a baseline."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch
        self.what = "cuda max_memory_allocated" if self.cuda else "peak RSS above the pre-model baseline"
        self.base = self._rss() if not self.cuda else 0.0

    @staticmethod
    def _rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            return
        try:  # Linux: "5" resets the peak RSS (VmHWM) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def peak_mb(self) -> float:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**20
        try:
            with open("/proc/self/status") as f:
                return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024 - self.base
        except (OSError, AttributeError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - self.base

    def reserved_mb(self) -> float | None:
        return self.torch.cuda.max_memory_reserved() / 2**20 if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def setup_child(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        if torch.device(args.device).index is not None:
            torch.cuda.set_device(torch.device(args.device))
        torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
        torch.backends.cudnn.allow_tf32 = bool(args.tf32)


def device_info(args) -> dict:
    import torch

    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
    return {"gpu": None}


def count_step(step: Callable[[], None]) -> tuple[int, int]:
    """Aten ops and host syncs of one call of ``step`` (a ``TorchDispatchMode``; counts, not time)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sync = torch.ops.aten._local_scalar_dense.default

    class Counter(TorchDispatchMode):
        ops = syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.syncs += func is sync
            return func(*args, **(kwargs or {}))

    counter = Counter()
    with counter:
        step()
    return counter.ops, counter.syncs


def job_speed(args, send, *, model: str, variant: str) -> dict:
    import torch

    setup_child(args)
    memory = Memory(args.device)
    dtype = getattr(torch, args.dtype)
    tied, note = True, None
    while True:
        net = build_model(args, model, tied=tied, dtype=dtype)
        step = make_step(args, variant, net, args.batch)
        memory.reset()
        memory.sync()
        start = time.perf_counter()
        refusal = None
        try:
            step()
        except NotImplementedError as e:
            if not (variant == "opacus-ghost" and tied and is_tying_refusal(e)):
                raise
            refusal = str(e)
        if refusal is None:
            break
        # out of the except block, so the traceback (and the tied model's tensors it holds) is gone
        tied, note = False, f"tied weights refused ({refusal}); measured with an untied lm_head"
        net = step = None
        gc.collect()
        if memory.cuda:
            torch.cuda.empty_cache()
    memory.sync()
    first_s = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        step()
    memory.sync()
    peak_first = memory.peak_mb()
    memory.reset()
    times = []
    for _ in range(args.repeats):
        memory.sync()
        start = time.perf_counter()
        step()
        memory.sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    ops, syncs = count_step(step)
    out = {
        "status": "ok",
        "step_ms": median * 1000,
        "ops": ops,  # aten ops of one steady step (the CPU proxy of benchmarks/overhead.py, here on the device)
        "syncs": syncs,  # host syncs (aten._local_scalar_dense) of that step
        "min_step_ms": min(times) * 1000,
        "tokens_per_s": args.batch * args.seq / median,
        "first_step_ms": first_s * 1000,
        "peak_mb": memory.peak_mb(),
        "peak_first_mb": max(peak_first, memory.peak_mb()),
        "reserved_mb": memory.reserved_mb(),
        "memory": memory.what,
        "batch": args.batch,
        "seq": args.seq,
        "tied": tied,
        "params_m": sum(p.numel() for p in net.parameters()) / 1e6,
        **device_info(args),
    }
    if note:
        out["note"] = note
    return out


def is_oom(error: BaseException | None) -> bool:
    """An out-of-memory error, also when another error wraps it (``__cause__`` / ``__context__``)."""
    import torch

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.cuda.OutOfMemoryError):
            return True
        if isinstance(error, RuntimeError) and ("out of memory" in str(error) or "ALLOC_FAILED" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def largest_batch(
    fits: Callable[[int], bool],
    *,
    start: int,
    cap: int,
    resolution: float,
    time_left: Callable[[], float],
    report: Callable[[dict], None] = lambda state: None,
) -> dict:
    """The largest ``b <= cap`` with ``fits(b)``: doubling from ``start`` (halving if ``start`` fails), then bisection
    until ``fail - fit <= max(1, resolution * fit)``. A trial starts only if ``time_left()`` exceeds twice the last
    one's duration. Returns ``max_batch`` (largest fit, 0 if none), ``first_fail`` (smallest failure, or None),
    ``stopped`` ("resolution", "cap", "time budget") and ``trials`` ([batch, fits, seconds] each)."""
    fit, fail = 0, None
    trials: list[list] = []
    last = 0.0

    def trial(b: int) -> bool | None:
        nonlocal fit, fail, last
        if trials and time_left() < 2 * last:
            return None
        t0 = time.perf_counter()
        ok = fits(b)
        last = time.perf_counter() - t0
        trials.append([b, ok, round(last, 3)])
        if ok:
            fit = max(fit, b)
        else:
            fail = b if fail is None else min(fail, b)
        report({"max_batch": fit, "first_fail": fail, "trials": list(trials)})
        return ok

    def done(stopped: str) -> dict:
        return {"max_batch": fit, "first_fail": fail, "stopped": stopped, "trials": trials}

    b = max(1, min(start, cap))
    ok = trial(b)
    if ok is None:
        return done("time budget")
    while not ok and b > 1:  # even the first size fails: halve
        b //= 2
        ok = trial(b)
        if ok is None:
            return done("time budget")
    if not ok:
        return done("resolution")
    while fail is None:  # doubling
        if fit >= cap:
            return done("cap")
        ok = trial(min(2 * fit, cap))
        if ok is None:
            return done("time budget")
    while fail - fit > max(1, int(resolution * fit)):  # bisection
        if trial((fit + fail) // 2) is None:
            return done("time budget")
    return done("resolution")


def job_maxbatch(args, send, *, model: str, variant: str, budget_s: float) -> dict:
    import torch

    setup_child(args)
    deadline = time.monotonic() + budget_s
    dtype = getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")
    state = {"tied": True, "note": None}

    def fits(batch: int) -> bool:
        """True if two steps run at ``batch``; False on an OOM (memory freed); any other error ends the search."""
        error = None
        try:
            return fits_once(batch)
        except Exception as e:  # an OOM is an answer; anything else is re-raised below
            error = e
        if not is_oom(error):
            raise error
        # drop the frames (and the activations they hold) before freeing the cached blocks
        error.__traceback__ = error.__context__ = error.__cause__ = None
        del error
        free()
        return False

    def free() -> None:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def fits_once(batch: int) -> bool:
        net = build_model(args, model, tied=state["tied"], dtype=dtype)
        try:
            step = make_step(args, variant, net, batch)
            for _ in range(2):  # the first step (hf_dp: plan and checks) and a steady one (optimizer state)
                step()
            if cuda:
                torch.cuda.synchronize()
        except NotImplementedError as e:
            if not (variant == "opacus-ghost" and state["tied"] and is_tying_refusal(e)):
                raise
            state.update(tied=False, note=f"tied weights refused ({e}); searched with an untied lm_head")
        else:
            return True
        finally:
            net = step = None  # noqa: F841 - drop the references before the caller frees memory
        free()
        return fits_once(batch)

    def report(partial: dict) -> None:
        send({"partial": True, "tied": state["tied"], **partial})

    result = largest_batch(
        fits,
        start=args.batch,
        cap=args.max_batch_cap,
        resolution=args.resolution,
        time_left=lambda: deadline - time.monotonic(),
        report=report,
    )
    out = {"status": "ok", **result, "seq": args.seq, "tied": state["tied"], **device_info(args)}
    if state["note"]:
        out["note"] = state["note"]
    return out


class RandomTokens:
    """``n`` random token sequences (labels = inputs): the data of the precision check."""

    def __init__(self, n: int, seq: int, vocab: int):
        import torch

        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def collate(features: list[dict]) -> dict:
    import torch

    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def train_update(args, base, precision: str, out_dir: str) -> tuple[dict, list, object]:
    """Train a copy of ``base`` with DPTrainer at sigma = 0; returns ({name: update}, losses, trainer)."""
    import torch

    from hf_dp import DPTrainer, DPTrainingArguments

    cpu = args.device == "cpu"
    model = copy.deepcopy(base)
    training_args = DPTrainingArguments(
        output_dir=os.path.join(out_dir, precision),
        report_to="none",
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        noise_multiplier=0.0,
        per_sample_max_grad_norm=1.0,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_steps=args.precision_steps,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        noise_seed=0,  # the same Poisson batches in every run (and no privacy: sigma is 0 anyway)
        use_cpu=cpu,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        fp16=precision == "fp16",
        bf16=precision == "bf16",
    )
    data = RandomTokens(8 * args.batch, args.seq, base.config.vocab_size)
    trainer = DPTrainer(model=model, args=training_args, train_dataset=data, data_collator=collate)
    if cpu and precision == "fp16":  # what accelerate sets up on a GPU (autocast + GradScaler), on the CPU
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.train()
    device = next(model.parameters()).device
    with torch.no_grad():
        update = {
            n: p.detach().double() - p0.detach().to(device).double()
            for (n, p), p0 in zip(model.named_parameters(), base.parameters(), strict=True)
        }
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return update, losses, trainer


def job_precision(args, send, *, precision: str) -> dict:
    import torch

    from hf_dp.step.loss_scale import NoisedOverflowScalePolicy

    setup_child(args)
    if args.device.startswith("cuda"):  # the fp32 reference in true fp32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    scale_log: list[tuple[float, float, float]] = []
    original = NoisedOverflowScalePolicy.update

    def spy(policy, noised_dropped):  # this process only: what the policy saw, step by step
        before = policy.scale
        after = original(policy, noised_dropped)
        scale_log.append((before, float(noised_dropped), after))
        return after

    NoisedOverflowScalePolicy.update = spy
    base = build_model(args, args.precision_model)
    base = base.cpu()
    out_dir = tempfile.mkdtemp(prefix="gpu_check_precision_")
    try:
        ref, ref_losses, _ = train_update(args, base, "fp32", out_dir)
        amp, amp_losses, trainer = train_update(args, base, precision, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    diff = math.sqrt(sum(float((amp[n] - ref[n]).pow(2).sum()) for n in ref))
    norm = math.sqrt(sum(float(ref[n].pow(2).sum()) for n in ref))
    worst_name, worst = None, -1.0
    for n in ref:
        d = float(ref[n].norm())
        if d > 0:
            rel = float((amp[n] - ref[n]).norm()) / d
            if rel > worst:
                worst_name, worst = n, rel
    out = {
        "status": "ok",
        "model": args.precision_model,
        "steps": trainer.state.global_step,
        "rel_update_diff": diff / norm if norm > 0 else float("nan"),
        "update_norm_fp32": norm,
        "worst_tensor": worst_name,
        "worst_tensor_rel_diff": worst,
        "loss_rel_diff": max((abs(a - b) / abs(b) for a, b in zip(amp_losses, ref_losses, strict=False)), default=None),
        "batch": args.batch,
        "seq": args.seq,
        **device_info(args),
    }
    if precision == "fp16":
        policy = trainer.dp_step.loss_scaling.policy if trainer.dp_step.loss_scaling is not None else None
        if policy is None:
            out["note"] = "no loss-scale policy: the trainer ran without an enabled GradScaler"
        else:
            out.update(
                loss_scale_start=scale_log[0][0] if scale_log else policy.scale,
                loss_scale_end=policy.scale,
                backoffs=sum(after < before for before, _, after in scale_log),
                dropped_noised=",".join(f"{d:g}" for _, d, _ in scale_log),
            )
    return out


# ---------------------------------------------------------------------------------------------- orchestration


def _child(fn, kwargs: dict, conn, log_path: str, args) -> None:
    """Body of a forked measurement process: its output to ``log_path``, its result (or error) to ``conn``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # also Python's streams, in case they were not the file descriptors (e.g. under pytest's capture)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        result = fn(args, conn.send, **kwargs)
    except Skip as e:
        result = {"status": "skipped", "reason": str(e)}
    except BaseException as e:  # every failure is reported, the run goes on
        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send({"final": True, **result})
    conn.close()


def run_job(fn, kwargs: dict, *, timeout: float, log_path: str, args) -> dict:
    """Run ``fn(args, send, **kwargs)`` in a forked process; its final dict, or the last partial one on a timeout."""
    import torch

    # fork after the imports (fast); a process where CUDA is already initialised cannot fork a CUDA child
    ctx = multiprocessing.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    recv, send = ctx.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    proc = ctx.Process(target=_child, args=(fn, kwargs, send, log_path, args), daemon=True)
    start = time.monotonic()
    proc.start()
    send.close()
    last = None
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0 or not recv.poll(left):
            break
        try:
            msg = recv.recv()
        except EOFError:
            break
        last = msg
        if msg.get("final"):
            break
    timed_out = last is None or not last.get("final")
    if timed_out and proc.is_alive():
        proc.kill()
    proc.join(10)
    wall = time.monotonic() - start
    if last is not None and last.get("final"):
        result = {k: v for k, v in last.items() if k != "final"}
    elif proc.exitcode not in (None, 0) and time.monotonic() - start < timeout:
        result = {"status": "failed", "reason": f"process died (exit code {proc.exitcode}): {_last_line(log_path)}"}
    else:
        result = {"status": "timeout", "reason": f"no result within {timeout:.3g} s (killed)"}
    if last is not None and last.get("partial") and result["status"] != "ok":
        partial = {k: v for k, v in last.items() if k != "partial"}
        stopped = "killed at the time limit" if result["status"] == "timeout" else "error"
        result = {**partial, **result, "stopped": stopped}
    result["wall_s"] = wall
    return result


def _last_line(path: str) -> str:
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == int(value) and abs(value) >= 1:
            return str(int(value))
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    if isinstance(value, list):
        return ",".join(_fmt(v) for v in value)
    text = str(value)
    return re.sub(r"\s+", " ", text)[:400]


KEY_ORDER = ["part", "model", "variant", "precision", "status", "max_batch"]


def emit(record: dict) -> None:
    """One tab-separated ``key=value`` line; ``reason`` and ``note`` last."""
    keys = [k for k in KEY_ORDER if k in record]
    keys += [k for k in record if k not in keys and k not in ("reason", "note", "trials")]
    keys += [k for k in ("trials", "note", "reason") if k in record]
    fields = []
    for k in keys:
        v = record[k]
        if v is None:
            continue
        if k == "trials":
            v = " ".join(f"{b}:{'ok' if ok else 'oom'}" for b, ok, _ in v)
        if k == "max_batch" and record.get("stopped") not in (None, "resolution"):
            fields.append(f"max_batch>={_fmt(v)}")
            continue
        fields.append(f"{k}={_fmt(v)}")
    print("\t".join(fields), flush=True)


def job_probe(args, send) -> dict:
    """Whether ``args.device`` runs here: in a child, so that this process never initialises CUDA (and can fork)."""
    import torch

    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise Skip(f"unsupported device {args.device!r} (cuda, cuda:N or cpu)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise Skip(f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})")
    setup_child(args)
    torch.ones(1, device=args.device).sum().item()
    return {"status": "ok", **device_info(args)}


def machine_line(args, probe: dict) -> dict:
    import torch
    import transformers

    try:
        import opacus

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = None
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "device": args.device,
        "gpu": probe.get("gpu"),
        "gpu_memory_gib": probe.get("gpu_memory_gib"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if args.device.startswith("cuda") else None,
        "transformers": transformers.__version__,
        "opacus": opacus_version,
        "python": platform.python_version(),
        "cpu": f"{platform.machine()} {os.cpu_count()} cpus",
        "hf_dp_commit": commit or None,
    }


def summary_rows(records: list[dict]) -> list[dict]:
    """Ratios to non-private per model: step time, peak memory (speed) and largest batch (maxbatch)."""
    rows = []
    models = list(dict.fromkeys(r["model"] for r in records if r.get("part") in ("speed", "maxbatch") and "model" in r))
    for model in models:
        speed = {r["variant"]: r for r in records if r.get("part") == "speed" and r.get("model") == model}
        batch = {r["variant"]: r for r in records if r.get("part") == "maxbatch" and r.get("model") == model}
        base_s, base_b = speed.get("non-private", {}), batch.get("non-private", {})
        for variant in VARIANTS:
            s, b = speed.get(variant), batch.get(variant)
            if s is None and b is None:
                continue
            row = {"model": model, "variant": variant}
            for rec, key in ((s, "speed"), (b, "maxbatch")):
                if rec is not None and rec.get("status") != "ok":
                    row[f"{key}_status"] = rec.get("status")
            if s is not None and s.get("status") == "ok":
                row["tokens_per_s"] = s["tokens_per_s"]
                if base_s.get("status") == "ok":
                    row["time_x"] = s["step_ms"] / base_s["step_ms"]
                    row["memory_x"] = s["peak_mb"] / base_s["peak_mb"] if base_s["peak_mb"] > 0 else None
            if b is not None and b.get("max_batch"):
                row["max_batch"] = b["max_batch"]
                row["max_batch_exact"] = b.get("stopped") == "resolution"
                if base_b.get("max_batch"):
                    row["max_batch_x"] = b["max_batch"] / base_b["max_batch"]
            row["tied"] = (s or b).get("tied", True)
            rows.append(row)
    return rows


def print_summary(rows: list[dict]) -> None:
    def cell(row, key, fmt="{:.2f}"):
        if row.get(key) is None:
            return "-"
        return fmt.format(row[key])

    print("\n| model | variant | step time (x non-private) | tokens/s | peak memory (x) | max batch | max batch (x) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        variant = row["variant"] + ("" if row["tied"] else " (untied lm_head)")
        status = row.get("speed_status")
        time_x = status if status else cell(row, "time_x")
        mb = cell(row, "max_batch", "{:d}")
        if row.get("max_batch") is not None and not row.get("max_batch_exact"):
            mb = f">={mb}"
        elif row.get("maxbatch_status"):
            mb = row["maxbatch_status"]
        print(
            f"| {row['model']} | {variant} | {time_x} | {cell(row, 'tokens_per_s', '{:.0f}')} | "
            f"{cell(row, 'memory_x')} | {mb} | {cell(row, 'max_batch_x')} |"
        )


def plan(args) -> list[tuple[str, list[tuple]]]:
    """Per part, its measurements: (record fields, job function, job kwargs)."""
    parts = args.parts or [p for p in PARTS if not (args.tiny and p == "maxbatch")]
    precisions = args.precisions or (["bf16"] if args.tiny else PRECISIONS)
    out = []
    for part in PARTS:
        if part not in parts:
            continue
        jobs = []
        if part == "speed":
            for model in args.models:
                for variant in args.variants:
                    jobs.append(({"part": part, "model": model, "variant": variant}, job_speed, {}))
        elif part == "precision":
            for precision in precisions:
                jobs.append(({"part": part, "model": args.precision_model, "precision": precision}, job_precision, {}))
        else:
            for model in args.maxbatch_models:
                for variant in args.variants:
                    jobs.append(({"part": part, "model": model, "variant": variant}, job_maxbatch, {}))
        out.append((part, jobs))
    return out


def skipped_by_mode(args) -> list[dict]:
    """What --tiny leaves out unless asked for."""
    out = []
    if args.tiny and args.parts is None:
        out.append({"part": "maxbatch", "status": "skipped", "reason": "--tiny skips the largest-batch search"})
    if args.tiny and args.precisions is None and (args.parts is None or "precision" in args.parts):
        out.append(
            {
                "part": "precision",
                "model": args.precision_model,
                "precision": "fp16",
                "status": "skipped",
                "reason": "--tiny skips fp16 (--precisions fp16 runs it with torch's CPU GradScaler)",
            }
        )
    return out


def main(argv=None) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    deadline = t0 + args.budget_s
    shapes = TINY_MODELS if args.tiny else MODELS
    print(
        f"# gpu_check: device {args.device}; T={args.seq}, B={args.batch} (speed), {args.warmup} warm-up + "
        f"{args.repeats} timed steps, {args.dtype}{', TF32' if args.tf32 else ''}, AdamW; models "
        + ", ".join(f"{m} {shapes[m][0]}x{shapes[m][1]} vocab {shapes[m][3]}" for m in shapes)
        + f"; budget {args.budget_s:.0f} s (speed {args.speed_budget_s:.0f}, precision {args.precision_budget_s:.0f}, "
        + (f"maxbatch {args.maxbatch_budget_s:.0f})" if args.maxbatch_budget_s else "maxbatch: the rest)"),
        flush=True,
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs: nothing to download
    # Imported once here, before any fork, so no measurement pays for them (none of them touches CUDA).
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import hf_dp  # noqa: F401

    try:
        import opacus  # noqa: F401
    except ImportError:
        pass
    log_dir = args.logs or tempfile.mkdtemp(prefix="gpu_check_logs_")
    os.makedirs(log_dir, exist_ok=True)
    probe = run_job(job_probe, {}, timeout=120, log_path=os.path.join(log_dir, "probe.log"), args=args)
    if probe["status"] != "ok":
        where = f" (log: {log_dir}/probe.log)" if probe["status"] != "skipped" or args.logs else ""
        if not where:
            shutil.rmtree(log_dir, ignore_errors=True)
        print(f"# cannot run on {args.device}: {probe.get('reason')}{where}", flush=True)
        return 2
    if probe.get("gpu"):
        print(f"# device: {probe['gpu']} ({probe['gpu_memory_gib']} GiB)", flush=True)
    budgets = {
        "speed": args.speed_budget_s,
        "precision": args.precision_budget_s,
        "maxbatch": args.maxbatch_budget_s or args.budget_s,
    }
    records: list[dict] = []
    for record in skipped_by_mode(args):
        records.append(record)
        emit(record)
    failed = False
    for part, jobs in plan(args):
        part_deadline = min(time.monotonic() + budgets[part], deadline)
        for n, (fields, fn, kwargs) in enumerate(jobs):
            left = part_deadline - time.monotonic()
            if left < 5:
                record = {**fields, "status": "skipped", "reason": f"time budget of part {part} spent"}
                if time.monotonic() > deadline - 5:
                    record["reason"] = f"time budget of the run ({args.budget_s:.0f} s) spent"
                records.append(record)
                emit(record)
                continue
            kwargs = dict(kwargs)
            if part != "precision":
                kwargs.update(model=fields["model"], variant=fields["variant"])
            else:
                kwargs.update(precision=fields["precision"])
            timeout = min(left, args.job_timeout_s)
            if part == "maxbatch":  # the part's time shared by its remaining searches; 10 s to start and end
                timeout = left / (len(jobs) - n)
                kwargs["budget_s"] = max(1.0, timeout - 10)
            log_path = os.path.join(log_dir, "_".join(str(v) for v in fields.values()) + ".log")
            result = run_job(fn, kwargs, timeout=timeout, log_path=log_path, args=args)
            record = {**fields, **result}
            if record["status"] in ("failed", "timeout"):
                failed = True
                record["log"] = log_path
            records.append(record)
            emit(record)
    rows = summary_rows(records)
    if rows:
        print_summary(rows)
    machine = machine_line(args, probe)
    print(
        f"\n# machine: {machine['gpu'] or 'no GPU'}"
        + (f" ({machine['gpu_memory_gib']} GiB)" if machine["gpu_memory_gib"] else "")
        + f", torch {machine['torch']}, CUDA {machine['cuda']}, cuDNN {machine['cudnn']}, transformers "
        f"{machine['transformers']}, opacus {machine['opacus']}, python {machine['python']}, {machine['cpu']}, "
        f"hf_dp {machine['hf_dp_commit']}; {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    if failed:
        print(f"# logs of the failed measurements: {log_dir}")
    elif not args.logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"config": vars(args), "machine": machine, "records": records, "summary": rows},
                f,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
