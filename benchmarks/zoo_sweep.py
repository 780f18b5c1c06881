"""The full zoo sweep (issue 25): tiny random configs of every model type in five auto mappings, against the
float64 per-example oracle, one line per (task, type, mode, variant) and a markdown summary.

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/zoo_sweep.py --modes bk-mixopt --variants default,eager \\
        --out /tmp/zoo_full.md | tee /tmp/zoo_full.txt
    .venv/bin/python benchmarks/zoo_sweep.py --types mixtral,t5 --modes bk-mixopt,bk,ghost,per-sample \\
        --variants default,eager,fp32,lora

Each line: outcome, task, type, mode, variant, the worst parameter with its engine/oracle norm ratio (wrong) or the
module a refusal names, and for engine runs the steady-state and first-step time against one plain
forward+backward. See ``tests/zoo/sweep.py`` for the classes and the batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "zoo"))

import torch  # noqa: E402
from sweep import MODES, OUTCOMES, TASKS, VARIANTS, Run, all_pairs, quiet_transformers, sweep_pair  # noqa: E402


def summary(runs: list[Run], elapsed: float, argv: str) -> str:
    lines = [f"# Zoo sweep\n\n`{argv}`: {len(runs)} runs in {elapsed / 60:.1f} min.\n"]
    pairs = {(r.task, r.model_type) for r in runs}
    lines.append(f"{len(pairs)} (task, type) pairs, {len({r.model_type for r in runs})} model types.\n")
    lines.append("## Outcomes per mode and variant\n")
    lines.append("| mode | variant | " + " | ".join(OUTCOMES) + " |")
    lines.append("|---|---|" + "---|" * len(OUTCOMES))
    keys = sorted({(r.mode, r.variant) for r in runs if r.mode != "-"})
    skipped = Counter(r.variant for r in runs if r.mode == "-")
    for mode, variant in keys:
        c = Counter(r.outcome for r in runs if r.mode == mode and r.variant == variant)
        c["skipped"] += skipped[variant]
        lines.append(f"| {mode} | {variant} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    lines.append("\n## Per task (every mode and variant)\n")
    lines.append("| task | pairs | " + " | ".join(OUTCOMES) + " |")
    lines.append("|---|---|" + "---|" * len(OUTCOMES))
    for task in sorted({r.task for r in runs}):
        c = Counter(r.outcome for r in runs if r.task == task)
        n = len({r.model_type for r in runs if r.task == task})
        lines.append(f"| {task} | {n} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    lines.append("\n## Per family (every mode and variant)\n")
    lines.append("| family | types | " + " | ".join(OUTCOMES) + " |")
    lines.append("|---|---|" + "---|" * len(OUTCOMES))
    fam_of = {}
    for r in runs:
        if r.family:
            fam_of[(r.task, r.model_type)] = r.family
    by_family: dict[str, Counter] = defaultdict(Counter)
    types_of: dict[str, set] = defaultdict(set)
    for r in runs:
        fam = fam_of.get((r.task, r.model_type), "(not built)")
        by_family[fam][r.outcome] += 1
        types_of[fam].add(r.model_type)
    for fam in sorted(by_family):
        c = by_family[fam]
        lines.append(f"| {fam} | {len(types_of[fam])} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    for outcome in ("wrong", "unclear"):
        bad = [r for r in runs if r.outcome == outcome]
        lines.append(f"\n## {outcome.capitalize()} ({len(bad)})\n")
        lines.append("| task | type | mode | variant | worst parameter | ratio | detail |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in bad:
            ratio = f"{r.ratio:.3g}x" if r.ratio is not None else ""
            lines.append(
                f"| {r.task} | {r.model_type} | {r.mode} | {r.variant} | {r.worst} | {ratio} | {_md(r.detail)} |"
            )
    refused = [r for r in runs if r.outcome == "refused"]
    lines.append(f"\n## Refused ({len(refused)}), grouped by message\n")
    groups: dict[str, list[Run]] = defaultdict(list)
    for r in refused:
        groups[_message_key(r.detail)].append(r)
    for key, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        where: dict[tuple[str, str], set] = defaultdict(set)
        for r in rs:
            where[(r.model_type, r.task)].add(r.mode if r.variant == "default" else f"{r.mode}/{r.variant}")
        who = ", ".join(f"{t} ({task}: {','.join(sorted(m))})" for (t, task), m in sorted(where.items()))
        lines.append(f"- **{len(rs)} runs, {len(where)} pairs** {_md(key)}: {who}")
    skipped_runs = [r for r in runs if r.outcome == "skipped"]
    lines.append(f"\n## Skipped ({len(skipped_runs)})\n")
    for r in skipped_runs:
        lines.append(f"- {r.model_type} ({r.task}, {r.variant}): {_md(r.detail[:200])}")
    timed = [r for r in runs if r.steady_s is not None and r.plain_s and r.outcome == "exact"]
    if timed:
        steady = [r.steady_s / r.plain_s for r in timed]
        first = [r.first_s / r.plain_s for r in timed]
        lines.append("\n## Cost (exact runs, engine time / one plain forward+backward)\n")
        lines.append("| | median | p90 | max |")
        lines.append("|---|---|---|---|")
        for name, xs in (("steady state", steady), ("first step", first)):
            xs = sorted(xs)
            lines.append(
                f"| {name} | {statistics.median(xs):.2f}x | {xs[int(0.9 * (len(xs) - 1))]:.2f}x | {xs[-1]:.2f}x |"
            )
        lines.append("\n## Cost per run (exact runs, the same ratios)\n")
        lines.append("| task | type | mode | variant | steady state | first step |")
        lines.append("|---|---|---|---|---|---|")
        for r in sorted(timed, key=lambda r: (r.task, r.model_type, r.mode, r.variant)):
            lines.append(
                f"| {r.task} | {r.model_type} | {r.mode} | {r.variant} | {r.steady_s / r.plain_s:.2f}x "
                f"| {r.first_s / r.plain_s:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _message_key(message: str) -> str:
    """A refusal message with the model-specific names dropped, so that one cause groups together."""
    import re

    key = re.sub(r"`[^`]*`|'[^']*'|\"[^\"]*\"", "<name>", message)
    key = re.sub(r"\b[\w]+(\.[\w]+)+\b", "<module>", key)
    key = re.sub(r"\d+", "N", key)
    return key[:220]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {','.join(TASKS)}")
    parser.add_argument("--types", default=None, help="comma-separated model types (default: all)")
    parser.add_argument("--modes", default="bk-mixopt", help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--variants", default="default,eager", help=f"comma-separated, from {','.join(VARIANTS)}")
    parser.add_argument("--out", default=None, help="write the markdown summary here")
    parser.add_argument("--no-timing", action="store_true", help="skip the timing steps (faster)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per (task, type, variant)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny models: 1)")
    args = parser.parse_args(argv)
    quiet_transformers()
    torch.set_num_threads(args.threads)
    tasks = args.tasks.split(",")
    for t in tasks:
        if t not in TASKS:
            parser.error(f"unknown task {t!r}; choose from {list(TASKS)}")
    modes = args.modes.split(",")
    variants = args.variants.split(",")
    types = args.types.split(",") if args.types else None
    pairs = all_pairs(tasks, types)
    if not pairs:
        parser.error("no (task, type) pair matches")
    runs: list[Run] = []
    start = time.perf_counter()
    for task, model_type in pairs:
        t0 = time.perf_counter()
        for run in sweep_pair(task, model_type, modes, variants, timing=not args.no_timing, timeout_s=args.timeout):
            runs.append(run)
            print(run.line(), flush=True)
        print(f"# {task} {model_type} took {time.perf_counter() - t0:.1f}s", flush=True)
    elapsed = time.perf_counter() - start
    text = summary(runs, elapsed, "python benchmarks/zoo_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
