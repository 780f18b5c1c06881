"""Memory and step time of FSDP2 against DDP for DP training on CPU: 2 processes, gloo.

Each variant launches 2 fresh spawned processes (accelerate's debug-launcher environment, gloo over the loopback
device), side by side in one run, and trains a randomly initialised GPT-2 built from ``GPT2Config`` (no downloads) on
random tokens held in memory, for ``--steps`` optimizer steps of ``--batch`` examples per process (AdamW,
``gradient_accumulation_steps=1``). A benchmark, not a test.

    python benchmarks/fsdp_memory.py                        # perf shape: GPT-2 4 x 256, vocab 8000, T = 96, N = 256
    python benchmarks/fsdp_memory.py --quick                # smoke run: 2 x 64, vocab 1000, T = 32, 4 steps
    python benchmarks/fsdp_memory.py --variants ddp-dp fsdp2-dp
    python benchmarks/fsdp_memory.py --mmap-threshold 65536 # RSS that follows live memory (see below)
    python benchmarks/fsdp_memory.py --json out.json        # also every rank's per-step times, peaks, batch sizes
    python benchmarks/fsdp_memory.py --shape gpt2-small     # 12 x 768, vocab 50257, T = 128: not for 2 cores
                                                            # (one non-private step took ~25 s there)

Variants:

* ``ddp-dp``: :class:`~hf_dp.DPTrainer`, no ``fsdp`` (the Trainer wraps the model in DDP);
* ``fsdp2-dp``: :class:`~hf_dp.DPTrainer` with ``fsdp=True``,
  ``fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}``;
* ``fsdp2-nonprivate``: ``transformers.Trainer`` with the same FSDP2 config and data (causal-LM loss, labels =
  input_ids);
* ``ddp-nonprivate``: ``transformers.Trainer``, DDP.

accelerate enables FSDP only on accelerator device types and silently trains with DDP on CPU; the FSDP2 variants
patch accelerate's ``AcceleratorState.__init__`` in each process (:func:`allow_fsdp_on_cpu`, as
``tests/step/test_fsdp.py`` does) so that the FSDP plugin is taken on ``MULTI_CPU`` too; a FSDP2 variant whose
parameters are not DTensors after training is reported as failed.

The DP variants use the DPTrainer's defaults (Poisson sampling, so a process's micro-batch has ``--batch`` examples
in expectation; ``bk-mixopt``; the self-check on the first micro-batch) with ``noise_multiplier`` fixed and, by
default, ``noise_seed=0``, so that both draw the same batches. Each line gives the variant, the number of processes
and, for rank 0 / rank 1:

* ``peak_rss_MB``: ``getrusage(RUSAGE_SELF).ru_maxrss`` after training minus the RSS (``/proc/self/statm``) right
  after the model was built: the peak growth over the whole ``train()`` call, first steps (plan proof, self-check)
  included, exact (the kernel's high-water mark, not sampled);
* ``step_ms``: median time from ``on_step_begin`` to ``on_step_end`` (``time.perf_counter``) over the steps after the
  first two;
* ``params_per_rank``: parameter elements this process holds after training (a DTensor's local shard, each tied
  parameter once);
* ``steady_rss_MB``: the largest RSS sampled (every ``--sample-ms`` by a thread reading ``/proc/self/statm``) during
  the steps after the first two, minus the same baseline: the memory of a steady step, without the one-time costs of
  the first steps (sampled, so it can miss a short peak);
* ``optim_per_rank``: elements of the optimizer's state tensors (AdamW's moments and step counters) on this process.

CPU memory is glibc's heap plus torch's allocations: freed blocks are not always returned to the system (glibc's
mmap threshold rises up to 32 MiB after large frees, and blocks below it stay in the heap), and gloo keeps its own
buffers; read the memory columns as rough. ``--mmap-threshold 65536`` fixes the threshold, so that RSS follows live
memory (and steps slow down, re-faulting pages). Each process uses ``--threads`` torch threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time

from step_time import perf_config  # the perf shape's GPT-2, as step_time.py builds it

VARIANTS = ["ddp-dp", "fsdp2-dp", "fsdp2-nonprivate", "ddp-nonprivate"]
#: shape presets: layers, hidden, heads, vocab, seq, examples (explicit arguments override them)
SHAPES = {
    "perf": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8000, "seq": 96, "examples": 256},
    "quick": {"layers": 2, "hidden": 64, "heads": 2, "vocab": 1000, "seq": 32, "examples": 64},
    "gpt2-small": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq": 128, "examples": 256},
}
COLUMNS = ["variant", "ranks", "peak_rss_MB", "step_ms", "params_per_rank", "steady_rss_MB", "optim_per_rank"]
WORLD_SIZE = 2


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``--quick`` is ``--shape quick`` with 4 steps)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="perf", choices=sorted(SHAPES))
    p.add_argument("--quick", action="store_true", help="smoke run: --shape quick, 4 steps")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--examples", type=int, help="training set size N")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (expected size under Poisson)")
    p.add_argument("--steps", type=int, help="max_steps (default 6, 4 with --quick); the first 2 are not timed")
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument(
        "--noise-seed",
        type=int,
        default=0,
        help="DPTrainingArguments.noise_seed (tests and benchmarks only): with a fixed seed both DP variants draw the "
        "same Poisson batches, so that their memory and step times compare the same batch sizes; -1: from the OS",
    )
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--sample-ms", type=float, default=2.0, help="RSS sampling interval for steady_rss_MB")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        help="MALLOC_MMAP_THRESHOLD_ of the processes (bytes): glibc then serves every block at least this large by "
        "mmap and unmaps it on free, so that RSS follows live memory more closely (default: glibc's dynamic "
        "threshold, which rises up to 32 MiB after large frees and keeps freed blocks below it in the heap)",
    )
    p.add_argument("--json", help="also write the results (one dict per variant) to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.shape = "quick"
    if args.steps is None:
        args.steps = 4 if args.quick else 6
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 3:
        p.error("--steps must be at least 3 (the first 2 are not timed)")
    return args


def allow_fsdp_on_cpu() -> None:
    """Let accelerate take the FSDP plugin on ``MULTI_CPU`` processes (it otherwise falls back to DDP on CPU).

    A copy of ``tests/helpers/distributed.py``'s ``allow_fsdp_on_cpu``: after accelerate's own
    ``AcceleratorState.__init__``, do what accelerate does for the GPU device types (distributed type FSDP, the plugin
    kept). Idempotent."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_hf_dp_patched", False):
        return

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    init._hf_dp_patched = True
    AcceleratorState.__init__ = init


def rss_mb() -> float:
    """This process's resident set size now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def max_rss_mb() -> float:
    """This process's peak resident set size so far (the kernel's high-water mark), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RSSSampler:
    """A daemon thread that keeps the largest RSS seen since the last :meth:`reset`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_mb())

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def reset(self) -> None:
        """Forget the peak so far."""
        self.peak = rss_mb()

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


def _random_dataset(args):
    import torch

    class RandomTokens(torch.utils.data.Dataset):
        """``examples`` sequences of ``seq`` uniform random tokens (no padding), labels = input_ids."""

        def __init__(self):
            self.ids = torch.randint(
                0, args.vocab, (args.examples, args.seq), generator=torch.Generator().manual_seed(0)
            )

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            ids = self.ids[i]
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    return RandomTokens()


def _collate(features):
    import torch

    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def train_variant(variant: str, args: argparse.Namespace, result_dir: str) -> None:
    """One process of one variant: build, train, measure; write this rank's results to ``result_dir``."""
    import torch
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from hf_dp import DPTrainer, DPTrainingArguments

    torch.set_num_threads(args.threads)
    fsdp = variant.startswith("fsdp2")
    private = variant.endswith("-dp")
    if fsdp:
        allow_fsdp_on_cpu()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rss_before_model = rss_mb()
    torch.manual_seed(0)
    config = perf_config(args)
    config.bos_token_id = config.eos_token_id = args.vocab - 1
    model = GPT2LMHeadModel(config)
    dataset = _random_dataset(args)
    batch_sizes: list[int] = []  # examples of each micro-batch this process collated

    def collate(features):
        batch_sizes.append(len(features))
        return _collate(features)

    baseline = rss_mb()
    max_rss_at_baseline = max_rss_mb()

    common = dict(
        output_dir=os.path.join(result_dir, variant),
        report_to="none",
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        optim="adamw_torch",
        learning_rate=1e-4,
        save_strategy="no",
        logging_steps=args.steps,
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=0,
    )
    if fsdp:
        common.update(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    if private:
        noise_seed = None if args.noise_seed < 0 else args.noise_seed
        training_args = DPTrainingArguments(**common, noise_multiplier=args.noise_multiplier, noise_seed=noise_seed)
        trainer = DPTrainer(model=model, args=training_args, train_dataset=dataset, data_collator=collate)
    else:
        training_args = TrainingArguments(**common)
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collate)
    del model

    sampler = RSSSampler(args.sample_ms / 1000)
    times: list[float] = []
    step_peaks: list[float] = []  # sampled peak RSS of each step (from on_step_begin to on_step_end)

    class Timer(TrainerCallback):
        """Times each optimizer step and keeps its sampled peak RSS."""

        start = 0.0

        def on_step_begin(self, train_args, state, control, **kwargs):
            sampler.reset()
            self.start = time.perf_counter()

        def on_step_end(self, train_args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)
            step_peaks.append(max(sampler.peak, rss_mb()))

    trainer.add_callback(Timer())
    sampler.start()
    trainer.train()
    sampler.stop()
    peak = max_rss_mb()

    model = trainer.model
    parameters = {id(p): p for p in model.parameters()}.values()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    optim_numel = sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )
    kinds = sorted({type(p).__name__ for p in parameters})
    if fsdp and kinds != ["DTensor"]:
        raise RuntimeError(f"{variant}: parameters are {kinds} after training, not sharded DTensors")
    result = {
        "variant": variant,
        "rank": rank,
        "world_size": trainer.args.world_size,
        "is_fsdp": bool(getattr(trainer, "is_fsdp_enabled", False)),
        "parameter_types": kinds,
        "params": sum(t.numel() for t in local),
        "optim_state": optim_numel,
        "step_s": times,
        "micro_batch_sizes": batch_sizes,
        "median_step_s": statistics.median(times[2:]),
        "rss_before_model_mb": rss_before_model,
        "baseline_mb": baseline,
        "max_rss_at_baseline_mb": max_rss_at_baseline,
        "peak_growth_mb": peak - baseline,
        "steady_growth_mb": max(step_peaks[2:]) - baseline,
        "step_peak_growth_mb": [p - baseline for p in step_peaks],
        "rss_after_train_mb": rss_mb(),
        "peak_mb": peak,
    }
    with open(os.path.join(result_dir, f"{variant}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


class _Job:
    """What each spawned process runs (picklable): :func:`train_variant`, then a barrier and the process group's
    destruction (gloo can abort at exit otherwise); the process's output goes to a log file in ``result_dir``."""

    def __init__(self, variant: str, args: argparse.Namespace, result_dir: str) -> None:
        self.variant, self.args, self.result_dir = variant, args, result_dir

    def __call__(self) -> None:
        import torch

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # the Trainer's logs and warnings of both processes go to a file, not between the table's lines
        log = open(os.path.join(self.result_dir, f"{self.variant}-rank{rank}.log"), "w")
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            train_variant(self.variant, self.args, self.result_dir)
        except BaseException:
            # no barrier: the other process may be waiting in a collective (the launcher ends it)
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            raise
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def launch(variant: str, args: argparse.Namespace, result_dir: str) -> list[dict]:
    """Run ``variant`` in ``WORLD_SIZE`` spawned gloo processes (accelerate's debug-launcher environment, as in
    ``tests/step/test_fsdp.py``); the results of every rank, by rank."""
    import socket

    from accelerate.utils import PrepareForLaunch, patch_environment
    from torch.multiprocessing import start_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (
        tempfile.TemporaryDirectory() as rdv,
        patch_environment(
            world_size=WORLD_SIZE,
            master_addr="127.0.0.1",
            master_port=str(port),
            accelerate_mixed_precision="no",
            accelerate_debug_rdv_file=os.path.join(rdv, "rdv"),
            accelerate_use_cpu="yes",
            gloo_socket_ifname="lo",
            omp_num_threads=str(args.threads),
            **({"malloc_mmap_threshold_": str(args.mmap_threshold)} if args.mmap_threshold is not None else {}),
        ),
    ):
        start_processes(
            PrepareForLaunch(_Job(variant, args, result_dir), debug=True), nprocs=WORLD_SIZE, start_method="spawn"
        )
    results = []
    for rank in range(WORLD_SIZE):
        with open(os.path.join(result_dir, f"{variant}-rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def format_line(variant: str, ranks: list[dict]) -> str:
    """One table line: the per-rank values joined by ``/`` (rank 0 first)."""

    def per_rank(key, fmt):
        return "/".join(format(r[key], fmt) for r in ranks)

    return "  ".join(
        [
            f"{variant:<17}",
            f"{len(ranks):>5}",
            f"{per_rank('peak_growth_mb', '.0f'):>11}",
            f"{'/'.join(format(r['median_step_s'] * 1000, '.1f') for r in ranks):>13}",
            f"{per_rank('params', 'd'):>17}",
            f"{per_rank('steady_growth_mb', '.0f'):>13}",
            f"{per_rank('optim_state', 'd'):>17}",
        ]
    )


def main(argv=None) -> None:
    """Run every variant and print one line each."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    print(
        f"# machine: {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, python "
        f"{platform.python_version()}; load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"# model GPT-2 {args.layers}x{args.hidden} ({args.heads} heads), vocab {args.vocab}, T={args.seq}, "
        f"N={args.examples}; {WORLD_SIZE} gloo processes x {args.threads} thread(s), batch {args.batch} per process, "
        f"{args.steps} steps (median over steps 3-{args.steps}), AdamW, sigma {args.noise_multiplier} (DP variants)"
    )
    allocator = "glibc defaults" if args.mmap_threshold is None else f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
    print(f"# memory: MiB above the RSS after model creation ({allocator}); values per rank as rank0/rank1")
    print("  ".join(COLUMNS))
    results, walls = {}, []
    with tempfile.TemporaryDirectory() as result_dir:
        for variant in args.variants:
            start = time.perf_counter()
            try:
                ranks = launch(variant, args, result_dir)
            except Exception as e:  # report it and go on with the other variants
                message = str(e).strip().splitlines()
                print(f"{variant}  FAILED  {message[-1] if message else type(e).__name__}", flush=True)
                print("# the end of each rank's log:")
                for rank in range(WORLD_SIZE):
                    path = os.path.join(result_dir, f"{variant}-rank{rank}.log")
                    if os.path.exists(path):
                        with open(path) as f:
                            tail = f.read().strip().splitlines()[-15:]
                        for line in tail:
                            print(f"#   rank {rank}: {line}", flush=True)
                continue
            results[variant] = ranks
            walls.append(f"{variant} {time.perf_counter() - start:.0f} s")
            print(format_line(variant, ranks), flush=True)
    print(f"# wall time per variant (2 processes: start, build, train): {', '.join(walls)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if len(results) < len(args.variants):
        sys.exit(1)


if __name__ == "__main__":
    main()
