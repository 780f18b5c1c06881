"""Step time and peak memory of one training step: non-private vs hf_dp (bk, bk-mixopt, layer-wise, ghost) vs Opacus.

Each variant runs in its own process (so peak memory is its own), side by side in one run; one line per
measurement, then a table of ratios to non-private. A benchmark, not a test.

    python benchmarks/step_time.py                       # CPU default: GPT-2 shape 4 x 256, vocab 8000, B=16, T=96
    python benchmarks/step_time.py --shape gpt2-small    # GPT-2 small: 12 x 768, vocab 50257, T=128 (B=4 on CPU)
    python benchmarks/step_time.py --checkpointing       # also every non-private / hf_dp variant with activation
                                                         # checkpointing (HF `gradient_checkpointing_enable()`)
    python benchmarks/step_time.py --device cuda --layers 12 --hidden 768 --vocab 50257 --seq 100 --batch 32
    python benchmarks/step_time.py --accum 4             # 4 micro-batches per optimizer step
    python benchmarks/step_time.py --variants hf_dp-first-step   # one-time costs: plan, checks, self-check

Variants: ``non-private``; ``hf_dp-bk``, ``hf_dp-bk-mixopt``, ``hf_dp-ghost`` (all-layer clipping);
``hf_dp-layer-wise`` (bk-mixopt, ``clipping_style="layer-wise"``: each layer clipped in its backward hook);
``hf_dp-automatic`` (bk-mixopt, ``clipping_fn="automatic"``); ``hf_dp-per-sample``; ``opacus``
(``GradSampleModule`` + ``DPOptimizer``, noise 0). A variant ending in ``+ckpt`` runs with activation checkpointing
(non-reentrant, the transformers default).

A step is ``--accum`` micro-batches (forward + backward each) and one AdamW step. For hf_dp the first micro-batch
after building the clipper also proves the plan (sub-batch probe, rule checks, verified forward, layout check of
the loss); the warm-up steps absorb it. ``hf_dp-first-step`` instead times that first micro-batch, a steady one,
and ``BookKeepingClipper.self_check`` on the micro-batch (3 examples), each in a fresh clipper.

Memory: on CPU the process's peak RSS above its RSS before the model was built, with glibc's default allocator
settings unless ``--keep-heap`` (which keeps freed memory in the heap, like a caching allocator on GPU, so that
memory-bound kernels are not timed re-faulting pages); on CUDA ``torch.cuda.max_memory_allocated``. Two peaks: the
whole run's (for hf_dp it includes the first micro-batch, which proves the plan), and the timed steps' alone after the
warm-up ("steady": the peak reset after the warm-up, ``/proc/self/clear_refs`` on Linux; the RSS then starts from
what the warm-up left in the heap).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ["non-private", "hf_dp-bk", "hf_dp-bk-mixopt", "hf_dp-layer-wise", "hf_dp-ghost", "opacus"]
EXTRA_VARIANTS = ["hf_dp-per-sample", "hf_dp-automatic", "hf_dp-first-step"]
#: variant -> BookKeepingClipper keywords
HF_DP = {
    "hf_dp-bk": {"mode": "bk"},
    "hf_dp-bk-mixopt": {"mode": "bk-mixopt"},
    "hf_dp-ghost": {"mode": "ghost"},
    "hf_dp-per-sample": {"mode": "per-sample"},
    "hf_dp-layer-wise": {"mode": "bk-mixopt", "clipping_style": "layer-wise"},
    "hf_dp-automatic": {"mode": "bk-mixopt", "clipping_fn": "automatic"},
}
#: shape presets: layers, hidden, heads, vocab, seq, batch (explicit arguments override them)
SHAPES = {
    "cpu-default": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8000, "seq": 96, "batch": 16},
    "gpt2-small": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq": 128, "batch": 4},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="cpu-default", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS + EXTRA_VARIANTS)
    p.add_argument(
        "--checkpointing",
        action="store_true",
        help="also run every non-private and hf_dp variant with activation checkpointing (rows `<variant>+ckpt`)",
    )
    p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument(
        "--keep-heap",
        action="store_true",
        help="keep freed memory in glibc's heap (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ = 4 GiB), like a "
        "caching allocator on GPU; by default glibc's own settings, which unmap every large block on free",
    )
    args = p.parse_args(argv)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def perf_config(args):
    """The perf shape's GPT-2 configuration (``--vocab``, ``--seq``, ``--hidden``, ``--layers``, ``--heads``; no
    dropout, so that every variant computes the same step)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=args.vocab,
        n_positions=max(args.seq, 128),
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def run_variant(args) -> dict:
    import torch
    from transformers import GPT2LMHeadModel

    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_dp import BookKeepingClipper
    from hf_dp.losses import causal_lm_loss

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    base_rss = rss_mb()
    torch.manual_seed(0)
    cfg = perf_config(args)
    model = GPT2LMHeadModel(cfg).to(device, getattr(torch, args.dtype))
    model.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    position_ids = torch.arange(args.seq, device=device).expand(args.batch, -1)
    variant = args.variant
    base = variant.removesuffix("+ckpt")
    if variant.endswith("+ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "hf_dp-first-step":
        return first_step_costs(args, model, ids, position_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clipper = None
    if base in HF_DP:
        clipper = BookKeepingClipper(model, max_grad_norm=1.0, **HF_DP[base])
    if variant == "opacus":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        model = GradSampleModule(model)
        optimizer = DPOptimizer(optimizer, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=args.batch)

    graph_grads = []

    def step():
        for _ in range(args.accum):
            out = model(input_ids=ids, position_ids=position_ids)
            loss = causal_lm_loss(out.logits, ids, reduction="sum")
            if base == "non-private":
                loss.sum().backward()
            elif clipper is not None:
                clipper.backward(loss)
            else:
                loss.sum().backward()
        graph_grads.append(sum(p.grad is not None and p.grad.grad_fn is not None for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    peak_before, whole_cuda = 0.0, 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        if i == args.warmup - 1:  # the steady steps' own peak from here (the first step proves hf_dp's plan)
            peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            whole_cuda = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
            _reset_peak(torch, cuda)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steady = (torch.cuda.max_memory_allocated() / 2**20) if cuda else _peak_since_reset() - base_rss
    result = {
        "variant": variant,
        "median_s": statistics.median(times),
        "tokens_per_s": args.batch * args.seq / statistics.median(times),
        "peak_mb": max(whole_cuda, steady) if cuda else max(peak_rss, peak_before) - base_rss,
        "steady_peak_mb": steady,
        "memory": "cuda max_memory_allocated" if cuda else "peak RSS above the pre-model baseline",
        "grads_with_graph": max(graph_grads),
    }
    return result


def _reset_peak(torch, cuda: bool) -> None:
    """Start a new peak: CUDA's allocator statistics, or the process's ``VmHWM`` (Linux: ``/proc/self/clear_refs``)."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_since_reset() -> float:
    """``VmHWM`` in MB: the peak RSS since the last :func:`_reset_peak` (the process's peak where it cannot reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def first_step_costs(args, model, ids, position_ids) -> dict:
    """One-time costs of hf_dp: the first micro-batch of a fresh clipper (plan and checks), a steady micro-batch,
    and ``self_check`` on the same micro-batch, each the median over ``--repeats`` fresh clippers."""
    import torch

    from hf_dp import BookKeepingClipper
    from hf_dp.losses import causal_lm_loss

    batch = {"input_ids": ids, "position_ids": position_ids}

    def loss_fn(m, b):
        return causal_lm_loss(m(**b).logits, b["input_ids"], reduction="sum")

    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    first, steady, check = [], [], []
    for _ in range(args.repeats):
        clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk-mixopt")
        for times in (first, steady):
            sync()
            start = time.perf_counter()
            clipper.backward(loss_fn(model, batch))
            sync()
            times.append(time.perf_counter() - start)
        clipper.remove()
        model.zero_grad(set_to_none=True)
        clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk-mixopt")
        sync()
        start = time.perf_counter()
        clipper.self_check(batch, loss_fn, num_examples=3)
        sync()
        check.append(time.perf_counter() - start)
        clipper.remove()
    return {
        "variant": "hf_dp-first-step",
        "first_s": statistics.median(first),
        "steady_s": statistics.median(steady),
        "self_check_s": statistics.median(check),
    }


def main(argv=None):
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    passthrough = [a for a in passthrough if a != "--checkpointing"]
    print(
        f"# machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
        f"device {args.device}; model GPT-2 {args.layers}x{args.hidden}, vocab {args.vocab}, B={args.batch}, "
        f"T={args.seq}, {args.dtype}, {args.accum} micro-batch(es) per step; load {os.getloadavg()[0]:.2f}"
    )
    env = dict(os.environ)
    if args.keep_heap and args.device == "cpu":
        env.update(MALLOC_MMAP_THRESHOLD_="4294967296", MALLOC_TRIM_THRESHOLD_="4294967296")
    print(f"# allocator: {'glibc, freed memory kept in the heap' if args.keep_heap else 'glibc default'}")
    variants = list(args.variants)
    if args.checkpointing:
        # ghost mode refuses checkpointing (its second backward pass is not book-kept)
        variants += [f"{v}+ckpt" for v in args.variants if v == "non-private" or (v in HF_DP and v != "hf_dp-ghost")]
    results = []
    for variant in variants:
        cmd = [sys.executable, __file__, *passthrough, "--variant", variant]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"{variant}\tFAILED\t{proc.stderr.strip().splitlines()[-1] if proc.stderr else ''}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if variant == "hf_dp-first-step":
            print(
                f"{variant}\tfirst micro-batch {r['first_s'] * 1000:.0f} ms\tsteady {r['steady_s'] * 1000:.0f} ms"
                f"\tself_check {r['self_check_s'] * 1000:.0f} ms"
            )
            continue
        results.append(r)
        print(
            f"{variant}\tstep {r['median_s'] * 1000:.1f} ms\t{r['tokens_per_s']:.0f} tok/s\tpeak {r['peak_mb']:.0f} MB"
            f"\tsteady peak {r['steady_peak_mb']:.0f} MB"
            f"\tp.grad with a graph: {r.get('grads_with_graph', '?')}"
        )
    base = next((r for r in results if r["variant"] == "non-private"), None)
    base_ckpt = next((r for r in results if r["variant"] == "non-private+ckpt"), None)
    if base:
        same = " | x non-private with the same checkpointing (time, memory)" if base_ckpt else ""
        print(
            f"\n| variant | step time (x non-private) | peak memory (x non-private) | steady steps' peak (x "
            f"non-private){same} |"
        )
        print("|---|---|---|---|" + ("---|" if base_ckpt else ""))
        for r in results:
            line = (
                f"| {r['variant']} | {r['median_s'] / base['median_s']:.2f} | {r['peak_mb'] / base['peak_mb']:.2f} | "
                f"{r['steady_peak_mb'] / base['steady_peak_mb']:.2f} |"
            )
            if base_ckpt:
                ref = base_ckpt if r["variant"].endswith("+ckpt") else base
                line += f" {r['median_s'] / ref['median_s']:.2f}, {r['peak_mb'] / ref['peak_mb']:.2f} |"
            print(line)


if __name__ == "__main__":
    main()
