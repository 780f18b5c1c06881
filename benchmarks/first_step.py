"""Where the first step of a plan goes (issue 25): the engine's first step on tiny zoo models, split into its parts,
each against one plain forward+backward of the same model and batch (float64, a padded batch of 3, bk-mixopt).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_step.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_step.py causal-lm:llama seq-cls:bert

One line per model (the median of three fresh clippers) and a median line. Parts: ``init`` (construction),
``forward`` (the first forward pass without the proof), ``proof`` (the plan: ``probe`` = the sub-batch runs on 1 and
2 examples, ``rules`` = the rule checks against autograd, the rest = layouts, coverage, expansions), ``support`` (the
two backward passes that check each loss depends on its own example), ``backward`` (the rest of the first
``clipper.backward``), ``first`` (all of it), and the second step's ``steady`` (forward + backward) for comparison.
The timers wrap the engine's own methods; nothing else changes.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "zoo"))

import torch  # noqa: E402
from sweep import Skip, _time_plain, _with_dtype, prepare, quiet_transformers  # noqa: E402

import hf_dp.engine.backward as backward_side  # noqa: E402
import hf_dp.engine.probe as probe  # noqa: E402
import hf_dp.engine.proof as proof  # noqa: E402
import hf_dp.engine.rule_choice as rule_choice  # noqa: E402
from hf_dp.engine.clipper import BookKeepingClipper  # noqa: E402

DEFAULT = (
    "causal-lm:llama causal-lm:gpt2 seq-cls:bert causal-lm:qwen2 seq2seq:t5 causal-lm:mixtral seq-cls:roberta "
    "causal-lm:phi3 token-cls:deberta-v2 causal-lm:gemma2 image-cls:vit causal-lm:opt"
).split()
SPENT: collections.Counter = collections.Counter()


def _timed(owner, name: str, key: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _install_timers() -> None:
    _timed(proof.PlanProof, "_make_plan", "proof")
    _timed(probe.Prober, "run", "probe")
    _timed(rule_choice, "choose_rule", "rules")  # looked up there by `choose_rules`
    _timed(backward_side.BackwardBookkeeping, "_support_check", "support")


def measure(task: str, model_type: str, repeats: int = 3) -> dict[str, float] | None:
    try:
        prep = prepare(task, model_type, "default")
    except Skip as err:
        print(f"# {model_type}: skipped ({err})")
        return None
    plain = _time_plain(prep, repeats=4)
    rows = []
    for _ in range(repeats):
        SPENT.clear()
        with _with_dtype(prep.dtype):
            model = copy.deepcopy(prep.model)
            t0 = time.perf_counter()
            clipper = BookKeepingClipper(model, max_grad_norm=prep.max_grad_norm, mode="bk-mixopt")
            t1 = time.perf_counter()
            loss = prep.loss_fn(model, prep.batch)
            t2 = time.perf_counter()
            clipper.backward(loss)
            t3 = time.perf_counter()
            clipper.backward(prep.loss_fn(model, prep.batch))
            t4 = time.perf_counter()
            clipper.remove()
        part = {
            "init": t1 - t0,
            "forward": t2 - t1 - SPENT["proof"],
            "proof": SPENT["proof"],
            "probe": SPENT["probe"],
            "rules": SPENT["rules"],
            "support": SPENT["support"],
            "backward": t3 - t2 - SPENT["support"],
            "first": t3 - t0,
            "steady": t4 - t3,
        }
        rows.append({k: v / plain for k, v in part.items()})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", nargs="*", default=DEFAULT, help="task:model_type (default: 12 common types)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet_transformers()
    _install_timers()
    columns = collections.defaultdict(list)
    for pair in args.pairs:
        task, model_type = pair.split(":")
        got = measure(task, model_type)
        if got is None:
            continue
        for k, v in got.items():
            columns[k].append(v)
        print(f"{model_type:14s} " + " ".join(f"{k}={v:.2f}x" for k, v in got.items()), flush=True)
    if columns:
        print("median         " + " ".join(f"{k}={statistics.median(v):.2f}x" for k, v in columns.items()))


if __name__ == "__main__":
    main()
