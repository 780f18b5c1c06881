"""Where the DP step's extra memory goes: peak memory per phase of one training step, and the buffers the engine
book-keeps, attributed per layer and per kind. A benchmark, not a test.

    OMP_NUM_THREADS=1 python benchmarks/dp_memory.py      # the perf shape: GPT-2 4 x 256, vocab 8000, B 16, T 128
    OMP_NUM_THREADS=1 python benchmarks/dp_memory.py --glibc-default      # RSS with glibc's own settings
    python benchmarks/dp_memory.py --device cuda      # CUDA's allocated bytes (torch.cuda.max_memory_allocated)

One process per variant (``non-private``, ``bk-mixopt``), side by side in one run. Memory is measured on CPU as
resident memory with glibc told to serve every block of 64 KiB or more by its own mapping and to unmap it on free
(``MALLOC_MMAP_THRESHOLD_=65536``, fixed): the RSS then follows the live tensors, not the heap's fragmentation. Each
phase's peak is read from ``VmHWM`` after resetting it (``/proc/self/clear_refs``), so one step gives the peak of its
forward pass, ``prepare`` (on the first step: the check that each loss depends on its own example, two backward passes
of one loss each with the graph kept), its backward pass, the clipped sum (``finish``) and the optimizer step, each
above the RSS before the step (parameters, optimizer state; no gradients, ``zero_grad(set_to_none=True)``). The first
step (the plan's proof) is reported apart from the steady one (the last of ``--steps``).

At the end of the backward pass (before ``finish``) the script lists what the engine holds: for each book-kept
per-example gradient, its factors, each storage counted once, split into

* ``activation``: a module input kept from the forward pass (a reference: the autograd graph holds it too until the
  backward pass reaches the module, after which only book-keeping keeps it);
* ``output grad``: an output gradient received in the backward pass (book-keeping keeps it until the clipping factors
  are known: by construction in one backward pass);
* ``instantiated``: per-example gradients formed in the backward pass (``bk-mixopt`` where it is cheaper);
* ``norm terms``: per-example squared norms waiting to be summed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from step_time import perf_config, rss_mb  # the perf shape, as step_time.py builds it

SHAPE = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8000, "seq": 128, "batch": 16}
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    return _status_kb("VmHWM") / 1024


class Phases:
    """Peak memory of each phase above the memory at the start of the step: RSS on CPU, the allocator's allocated
    bytes on CUDA (``torch.cuda.max_memory_allocated``, reset per phase)."""

    def __init__(self, cuda: bool = False) -> None:
        import torch

        self.cuda = torch.cuda if cuda else None
        self.base = self._now()
        self.peaks: dict[str, float] = {}
        self._reset()

    def _now(self) -> float:
        if self.cuda is None:
            return rss_mb()
        self.cuda.synchronize()
        return self.cuda.memory_allocated() / 2**20

    def _reset(self) -> None:
        if self.cuda is None:
            _reset_peak()
        else:
            self.cuda.reset_peak_memory_stats()

    def end(self, name: str) -> None:
        now = self._now()
        peak = _peak_mb() if self.cuda is None else self.cuda.max_memory_allocated() / 2**20
        self.peaks[name] = peak - self.base
        self.peaks[name + " (end)"] = now - self.base
        self._reset()


def book_kept(clipper, activations: set[int]) -> dict[str, float]:
    """MB the engine holds at the end of the backward pass, per kind and module (each storage once)."""
    import torch

    from hf_dp.layers.grads import FactoredGrad, IndexFactor, InstantiatedGrad

    p = clipper._pass
    names = clipper._names()[1]
    seen: set[int] = set()
    out: dict[str, float] = {}

    def add(kind: str, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            return
        seen.add(s.data_ptr())
        out[kind] = out.get(kind, 0.0) + s.nbytes() / 2**20

    for q, parts in p.pieces.items():
        name = names.get(q, "?").rsplit(".", 1)[0]
        for g in parts:
            if isinstance(g, InstantiatedGrad):
                add(f"instantiated: {name}", g.value)
            elif isinstance(g, FactoredGrad):
                for f in (g.left, g.right):
                    t = f.index if isinstance(f, IndexFactor) else f
                    kind = "activation" if t.untyped_storage().data_ptr() in activations else "output grad"
                    add(f"{kind}: {name}", t)
    for values in p.norm_dense.values():
        for v in values:
            add("instantiated (norm only)", v)
    for values in p.norm_parts.values():
        for v in values:
            add("norm terms", v)
    return out


def run_variant(args) -> dict:
    import torch
    from transformers import GPT2LMHeadModel

    from hf_dp import BookKeepingClipper
    from hf_dp.losses import causal_lm_loss

    torch.manual_seed(0)
    start = rss_mb() if args.device == "cpu" else 0.0
    cfg = perf_config(args)
    device = torch.device(args.device)
    model = GPT2LMHeadModel(cfg).to(device)
    model.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq)).to(device)
    position_ids = torch.arange(args.seq, device=device).expand(args.batch, -1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clipper = None
    if args.variant != "non-private":
        clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk-mixopt")
    result: dict = {"variant": args.variant}
    times = []
    for step in range(args.steps):
        began = time.perf_counter()
        phases = Phases(cuda=device.type == "cuda")
        out = model(input_ids=ids, position_ids=position_ids)
        loss = causal_lm_loss(out.logits, ids, reduction="sum")
        if not args.hold_logits:
            del out
        phases.end("forward")
        if clipper is None:
            loss.sum().backward()
            phases.end("backward")
            phases.peaks["finish"] = phases.peaks["prepare"] = 0.0
        else:
            clipper.prepare(loss)
            phases.end("prepare")
            activations = {
                t.untyped_storage().data_ptr()
                for use in clipper._pass.uses
                if use.captured is not None
                for t in use.captured.args
                if isinstance(t, torch.Tensor)
            }
            loss.sum().backward()
            phases.end("backward")
            kept = book_kept(clipper, activations)
            clipper.finish()
            phases.end("finish")
        del loss
        out = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phases.end("optimizer")
        times.append(time.perf_counter() - began)
        if step == 0:
            result["first_phases"] = phases.peaks
        if step == args.steps - 1:
            result["phases"] = phases.peaks
            result["held"] = phases.base - start  # at the step's start: model, optimizer state, what the engine kept
            result["book_kept"] = kept if clipper is not None else {}
    result["step_s"] = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in SHAPE.items():
        p.add_argument(f"--{key}", type=int, default=value)
    p.add_argument("--steps", type=int, default=4, help="steps per variant (the last one is measured)")
    p.add_argument(
        "--hold-logits",
        action="store_true",
        help="keep the model's output (the logits) alive through the backward pass, as step_time.py's loop does",
    )
    p.add_argument("--device", default="cpu", help="cuda: the allocator's peaks (max_memory_allocated) per phase")
    p.add_argument(
        "--glibc-default",
        action="store_true",
        help="glibc's own settings instead (RSS then also counts the heap's fragmentation, as step_time.py measures)",
    )
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    variants = ["non-private", "bk-mixopt"]
    print(
        f"# GPT-2 {args.layers} x {args.hidden}, vocab {args.vocab}, B {args.batch}, T {args.seq}, fp32, "
        f"{args.device}; "
        f"glibc: {'defaults' if args.glibc_default else ENV}; load {os.getloadavg()[0]:.2f}"
    )
    results = []
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for v in variants:
        proc = subprocess.run(
            [sys.executable, __file__, *passthrough, "--variant", v],
            capture_output=True,
            text=True,
            env=dict(os.environ) if args.glibc_default else {**os.environ, **ENV},
        )
        if proc.returncode:
            print(f"{v}: FAILED\n{proc.stderr[-3000:]}")
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = results[0]
    base_peak = max(base["phases"][k] for k in ("forward", "prepare", "backward", "finish", "optimizer"))
    print(
        "\n| variant | held between steps | forward | backward | finish | optimizer | step peak | x non-private "
        "(held + peak) | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ph = r["phases"]
        peak = max(ph[k] for k in ("forward", "prepare", "backward", "finish", "optimizer"))
        print(
            f"| {r['variant']} | {r['held']:.0f} | {ph['forward']:.0f} | {ph['backward']:.0f} | {ph['finish']:.0f} | "
            f"{ph['optimizer']:.0f} | {peak:.0f} | {(r['held'] + peak) / (base['held'] + base_peak):.3f} | "
            f"{r['step_s']:.3f} |"
        )
    print("\nthe first step (the plan's proof, once per plan):")
    for r in results:
        ph = r["first_phases"]
        phases = ("forward", "prepare", "backward", "finish", "optimizer")
        print(f"  {r['variant']}: " + ", ".join(f"{k} {ph[k]:.0f}" for k in phases))
    for r in results[1:]:
        kept = r["book_kept"]
        print(f"\n{r['variant']}: held by the engine at the end of the backward pass (MB, each storage once)")
        by_kind: dict[str, float] = {}
        for key, mb in kept.items():
            by_kind[key.split(":")[0]] = by_kind.get(key.split(":")[0], 0.0) + mb
        for kind, mb in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {kind}: {mb:.1f}")
        print("  per module (largest 12):")
        for key, mb in sorted(kept.items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {key}: {mb:.1f}")
        ph = r["phases"]
        print(
            f"  memory above the step's start at the end of the backward pass: {ph['backward (end)']:.0f} MB "
            f"(non-private: {base['phases']['backward (end)']:.0f}); finish's transient above that: "
            f"{ph['finish'] - ph['backward (end)']:.0f} MB"
        )


if __name__ == "__main__":
    main()
