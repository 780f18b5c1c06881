"""The PEFT tuner sweep (issue 38): every tuner peft can build (plus LoRA variants) on tiny float64 GPT-2, Llama, BERT
and T5, against the float64 per-example oracle with the engine alone, one line per (tuner, model, mode) and a
markdown summary (outcomes per mode, a tuner x model table, the wrong, unclear, refused and skipped runs).

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/peft_sweep.py --out /tmp/peft_full.md | tee /tmp/peft_full.txt
    .venv/bin/python benchmarks/peft_sweep.py --tuners lora,lora-dora,ia3 --models gpt2,t5 --modes bk-mixopt

See ``tests/peft_sweep/sweep.py`` for the outcomes and the batch, ``tests/peft_sweep/tuners.py`` for the configs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402
from peft_sweep.sweep import MODES, OUTCOMES, Run, all_pairs, quiet, sweep_pair  # noqa: E402
from peft_sweep.tuners import MODELS, TUNERS  # noqa: E402


def cell(runs: list[Run]) -> str:
    """One tuner x model cell: ``exact``, ``refused``, ``skipped``, or the outcome of each mode where they differ."""
    outcomes = {r.outcome for r in runs}
    if len(outcomes) == 1:
        return runs[0].outcome
    return ", ".join(f"{r.outcome} ({r.mode})" for r in runs)


def summary(runs: list[Run], elapsed: float, argv: str) -> str:
    lines = [f"# PEFT sweep\n\n`{argv}`: {len(runs)} runs in {elapsed / 60:.1f} min.\n"]
    lines.append("## Outcomes per mode\n")
    lines.append("| mode | " + " | ".join(OUTCOMES) + " |")
    lines.append("|---|" + "---|" * len(OUTCOMES))
    for mode in [m for m in (*MODES, "-") if any(r.mode == m for r in runs)]:
        c = Counter(r.outcome for r in runs if r.mode == mode)
        lines.append(f"| {'(not built)' if mode == '-' else mode} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    models = [m for m in MODELS if any(r.model == m for r in runs)]
    lines.append("\n## Tuner x model (every mode)\n")
    lines.append("| tuner | peft type | " + " | ".join(models) + " |")
    lines.append("|---|---|" + "---|" * len(models))
    by_pair: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in runs:
        by_pair[(r.tuner, r.model)].append(r)
    for tuner in [t for t in TUNERS if any(r.tuner == t for r in runs)]:
        cells = [cell(by_pair[(tuner, m)]) if by_pair[(tuner, m)] else "" for m in models]
        lines.append(f"| {tuner} | {TUNERS[tuner][0]} | " + " | ".join(cells) + " |")
    for outcome in ("wrong", "unclear", "refused"):
        bad = [r for r in runs if r.outcome == outcome]
        lines.append(f"\n## {outcome.capitalize()} ({len(bad)})\n")
        if bad:
            lines.append("| tuner | model | mode | worst | ratio | detail |")
            lines.append("|---|---|---|---|---|---|")
        for r in bad:
            ratio = f"{r.ratio:.3g}x" if r.ratio is not None else ""
            lines.append(f"| {r.tuner} | {r.model} | {r.mode} | {r.worst} | {ratio} | {_md(r.detail[:300])} |")
    skipped = [r for r in runs if r.outcome == "skipped"]
    lines.append(f"\n## Skipped ({len(skipped)}), grouped by reason\n")
    groups: dict[str, list[Run]] = defaultdict(list)
    for r in skipped:
        groups[_reason(r.detail)].append(r)
    for key, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- **{len(rs)}** {_md(key)}: " + ", ".join(f"{r.tuner} ({r.model})" for r in rs))
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _reason(detail: str) -> str:
    """A skip reason with the model-specific parts dropped, so that one cause groups together."""
    key = re.sub(r"\(at .*\)$", "", detail)
    key = re.sub(r"Conv1D\(nf=\d+, nx=\d+\)", "Conv1D", key)
    key = re.sub(r"'[A-Za-z0-9_]+'", "<name>", key)
    key = re.sub(r"\[.*", "[...]", key)
    return key.strip()[:200]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tuners", default=None, help="comma-separated tuner names (default: all)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--out", default=None, help="write the markdown summary here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per (tuner, model)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny models: 1)")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    tuners = args.tuners.split(",") if args.tuners else list(TUNERS)
    models = args.models.split(",")
    for name, known in (("tuner", TUNERS), ("model", MODELS)):
        unknown = [x for x in (tuners if name == "tuner" else models) if x not in known]
        if unknown:
            parser.error(f"unknown {name}(s) {unknown}; choose from {list(known)}")
    runs: list[Run] = []
    start = time.perf_counter()
    for tuner, model in all_pairs(tuners, models):
        for run in sweep_pair(tuner, model, args.modes.split(","), timeout_s=args.timeout):
            runs.append(run)
            print(run.line(), flush=True)
    elapsed = time.perf_counter() - start
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    text = summary(runs, elapsed, f"python benchmarks/peft_sweep.py {argv_text}".strip())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
