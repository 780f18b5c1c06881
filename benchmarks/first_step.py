"""Where the first step of a plan goes (issue 25): the engine's first step on tiny zoo models, split into its parts,
each against one plain forward+backward of the same model and batch (float64, a padded batch of 3, bk-mixopt).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_step.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_step.py causal-lm:llama seq-cls:bert

One line per model (the median of three fresh clippers) and a median line. Parts: ``init`` (construction),
``forward`` (the first forward pass without the proof), ``proof`` (the plan: ``probe`` = the sub-batch runs on 1 and
2 examples, ``rules`` = the rule checks against autograd, the rest = layouts, coverage, expansions), ``support`` (the
two backward passes that check each loss depends on its own example), ``backward`` (the rest of the first
``clipper.backward``), ``first`` (all of it), and ``steady``, the median of steps 2-4 (forward + backward), for
comparison. The timers wrap the engine's own methods; nothing else changes. ``first/steady`` is the first step over
the steady one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_step.py --trainer --steps 10 --repeats 3

The first step as a user meets it (issue 40): ``DPTrainer`` with its defaults (``dp_self_check`` on, Poisson
sampling, target epsilon 8) on a BertForSequenceClassification of 4 layers x 256 from a config (vocabulary 1000),
random token rows of 8 to 128 tokens padded to the longest row of each batch, expected batch 16, against ``Trainer``
on the same model and data, one after the other in one process. Per run: the set-up before the first step, the first
step, the median of the later steps and first/steady, in seconds of CPU time (``--profile``: cProfile of DPTrainer's
first step). The Poisson sampling seed is fixed (``noise_seed=0``): DPTrainer's batches are the same in every run.
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "zoo"))

import torch  # noqa: E402
from sweep import Skip, _time_plain, _with_dtype, prepare, quiet_transformers  # noqa: E402

import hf_dp.engine.backward as backward_side  # noqa: E402
import hf_dp.engine.planner as planner  # noqa: E402
import hf_dp.engine.probe as probe  # noqa: E402
import hf_dp.engine.proof as proof  # noqa: E402
from hf_dp.engine.clipper import BookKeepingClipper  # noqa: E402

DEFAULT = (
    "causal-lm:llama causal-lm:gpt2 seq-cls:bert causal-lm:qwen2 seq2seq:t5 causal-lm:mixtral seq-cls:roberta "
    "causal-lm:phi3 token-cls:deberta-v2 causal-lm:gemma2 image-cls:vit causal-lm:opt"
).split()
SPENT: collections.Counter = collections.Counter()
#: the later steps whose median is the steady step (one alone is too noisy a figure at these sizes)
STEADY_STEPS = 3


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
    _timed(planner, "choose_rules", "rules")  # looked up there by `build_plan`
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
            later = []
            for _ in range(STEADY_STEPS):
                t = time.perf_counter()
                clipper.backward(prep.loss_fn(model, prep.batch))
                later.append(time.perf_counter() - t)
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
            "steady": statistics.median(later),
        }
        row = {k: v / plain for k, v in part.items()}
        row["first/steady"] = part["first"] / part["steady"]
        rows.append(row)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


# ------------------------------------------------------------------------------------ BERT through DPTrainer
#: the issue's BERT: 4 layers x 256, micro-batch 16 (the expected Poisson batch), rows of 8 to 128 tokens
BERT = {
    "layers": 4, "hidden": 256, "heads": 4, "vocab": 1000, "batch": 16, "examples": 2000, "min_len": 8, "max_len": 128,
}  # fmt: skip


class _Texts(torch.utils.data.Dataset):
    """Random token sequences of varied lengths with a class label each (no padding: the collator pads)."""

    def __init__(self, shape: dict) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(shape["min_len"], shape["max_len"] + 1, (shape["examples"],), generator=g)
        self.rows = [torch.randint(3, shape["vocab"], (int(n),), generator=g) for n in lengths]
        self.labels = torch.randint(0, 2, (shape["examples"],), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.labels[i]}


def _pad_to_longest(features: list[dict]) -> dict:
    """Dynamic padding (as ``DataCollatorWithPadding``): each batch padded to its longest row, pad id 0."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = f["input_ids"]
        mask[i, : len(f["input_ids"])] = 1
    labels = torch.stack([f["labels"] for f in features])
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids), "labels": labels}


def _bert(shape: dict):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    h = shape["hidden"]
    cfg = BertConfig(
        vocab_size=shape["vocab"], hidden_size=h, num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        intermediate_size=4 * h, max_position_embeddings=512, num_labels=2, pad_token_id=0,
    )  # fmt: skip
    return BertForSequenceClassification(cfg)


def bert_trainer_run(*, dp: bool, steps: int, shape: dict = BERT, profile_first: bool = False) -> dict[str, float]:
    """One ``train()`` of ``steps`` steps (DPTrainer as a user runs it, or Trainer): the set-up before the first
    step, the first step and the median of the later ones, in seconds of this process's CPU time (one thread: the
    work done, whatever else the machine runs)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    marks: dict[str, list[float]] = {"begin": [], "end": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks["begin"].append(time.process_time())
            if profile_first and len(marks["begin"]) == 1:
                marks["profiler"] = cProfile.Profile()
                marks["profiler"].enable()

        def on_step_end(self, args, state, control, **kwargs):
            marks["end"].append(time.process_time())
            if profile_first and len(marks["end"]) == 1:
                marks["profiler"].disable()

    common = dict(
        per_device_train_batch_size=shape["batch"], learning_rate=5e-4, max_steps=steps, logging_steps=10**6,
        save_strategy="no", report_to="none", use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    model, data = _bert(shape), _Texts(shape)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dp:
            args = DPTrainingArguments(out, **common, target_epsilon=8.0, per_sample_max_grad_norm=1.0, noise_seed=0)
            trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=_pad_to_longest)
        else:
            trainer = Trainer(
                model=model, args=TrainingArguments(out, **common), train_dataset=data, data_collator=_pad_to_longest
            )
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(Clock())
        t0 = time.process_time()
        trainer.train()
    if profile_first:
        pstats.Stats(marks["profiler"]).sort_stats("cumulative").print_stats(60)
    spans = [e - b for b, e in zip(marks["begin"], marks["end"], strict=True)]
    return {"setup": marks["begin"][0] - t0, "first": spans[0], "steady": statistics.median(spans[1:])}


def _fresh_run(name: str, steps: int) -> dict[str, float]:
    """One run in a new process (``--fresh``): the first step then also pays the process's own warm-up (pages of
    memory touched for the first time, kernels initialized), as a user's first run does."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--trainer", "--steps", str(steps), "--one", name]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def trainer_main(steps: int, repeats: int, profile: bool, fresh: bool = False) -> None:
    """DPTrainer and Trainer side by side (alternating, ``repeats`` runs each): seconds and first/steady. In one
    process, DPTrainer's first run also pays the process's warm-up (about 0.5-0.7 s at this shape) and ``Trainer``'s
    runs do not; ``fresh``: every run in a new process, so both pay it."""
    rows: dict[str, list[dict[str, float]]] = {"DPTrainer": [], "Trainer": []}
    for _ in range(repeats):
        for name in rows:
            if fresh:
                got = _fresh_run(name, steps)
            else:
                dp, profiled = name == "DPTrainer", profile and name == "DPTrainer"
                got = bert_trainer_run(dp=dp, steps=steps, profile_first=profiled)
            rows[name].append(got)
            print(
                f"{name:10s} setup={got['setup']:.2f}s first={got['first']:.2f}s steady={got['steady']:.3f}s "
                f"first/steady={got['first'] / got['steady']:.2f}x",
                flush=True,
            )
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = statistics.median(r["first"] / r["steady"] for r in runs)
        print(
            f"median {name:10s} setup={med['setup']:.2f}s first={med['first']:.2f}s steady={med['steady']:.3f}s "
            f"first/steady={ratio:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", nargs="*", default=DEFAULT, help="task:model_type (default: 12 common types)")
    parser.add_argument("--trainer", action="store_true", help="the BERT 4x256 DPTrainer scenario instead")
    parser.add_argument("--steps", type=int, default=12, help="--trainer: steps per train() (default 12)")
    parser.add_argument("--repeats", type=int, default=1, help="--trainer: train() runs of each (default 1)")
    parser.add_argument("--profile", action="store_true", help="--trainer: cProfile of DPTrainer's first step")
    parser.add_argument("--fresh", action="store_true", help="--trainer: each run in a new process")
    parser.add_argument("--one", choices=["DPTrainer", "Trainer"], help=argparse.SUPPRESS)  # --fresh's child
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet_transformers()
    if args.one:
        import json

        print(json.dumps(bert_trainer_run(dp=args.one == "DPTrainer", steps=args.steps)))
        return
    if args.trainer:
        trainer_main(args.steps, args.repeats, args.profile, args.fresh)
        return
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
