"""Launch and sync overhead of hf_dp, counted exactly on CPU: aten ops and host syncs per micro-batch and per step.

On a GPU the arithmetic of a small or medium model is nearly free; what a step costs there is how many kernels it
launches, how much Python runs between them and how often the host waits for the device. None of that shows in CPU
step times at realistic widths, but all of it can be counted on CPU: a ``TorchDispatchMode`` sees every aten op (one
kernel launch, or more, on a GPU) and every ``aten._local_scalar_dense`` (``.item()``, ``bool(tensor)``,
``float(tensor)``, ``.tolist()``: a device-to-host sync on a GPU). The counts are exact and deterministic (fixed
seeds); the step times at a tiny width measure framework overhead only (Python and dispatch), at a realistic width the
usual mix.

Measurements (one line each), on GPT-2, Llama and BERT shapes built from configs (random init, no Hub):

* ``engine``: one micro-batch (forward, per-example loss, backward) with ``BookKeepingClipper.backward`` against the
  same micro-batch with a plain ``loss.sum().backward()``; the backward alone is counted too;
* ``trainer``: one optimizer step (``gradient_accumulation_steps=2``) of ``DPTrainer`` against ``Trainer`` with the
  same arguments (``max_grad_norm=0`` for both, DPTrainer's default); counted from one ``on_step_begin`` to the next
  (so it includes the optimizer, the scheduler and the Trainer's end-of-step work), and the first, non-sync,
  micro-batch alone (``on_step_begin`` to ``on_substep_end``).

Each hf_dp variant: ``bk``, ``bk-mixopt``, ``per-sample`` and ``ghost`` with all-layer clipping, and the three
one-backward modes with layer-wise clipping. Run (one process, one thread)::

    OMP_NUM_THREADS=1 python benchmarks/overhead.py                      # everything (a few minutes on CPU)
    OMP_NUM_THREADS=1 python benchmarks/overhead.py --widths tiny --models gpt2 --variants bk-mixopt
    OMP_NUM_THREADS=1 python benchmarks/overhead.py --where --widths tiny --models gpt2 --variants bk-mixopt
        # ... and print the Python stack (hf_dp / transformers frames) of every host sync in the counted step

Shapes: ``tiny`` is the issue's (12 layers, width 64, T 32, micro-batch 8, vocab 1000); ``real`` is the perf shape of
``benchmarks/step_time.py`` (4 layers, width 256, T 96, micro-batch 8, vocab 8000).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

WIDTHS = {
    "tiny": {"layers": 12, "hidden": 64, "heads": 4, "seq": 32, "batch": 8, "vocab": 1000},
    "real": {"layers": 4, "hidden": 256, "heads": 4, "seq": 96, "batch": 8, "vocab": 8000},
}
MODELS = ["gpt2", "llama", "bert"]
#: variant -> (clipping_mode, clipping_style)
VARIANTS = {
    "bk": ("bk", "all-layer"),
    "bk-mixopt": ("bk-mixopt", "all-layer"),
    "per-sample": ("per-sample", "all-layer"),
    "ghost": ("ghost", "all-layer"),
    "bk/layer-wise": ("bk", "layer-wise"),
    "bk-mixopt/layer-wise": ("bk-mixopt", "layer-wise"),
    "per-sample/layer-wise": ("per-sample", "layer-wise"),
}
SYNC = torch.ops.aten._local_scalar_dense.default
#: ops that launch nothing (besides views): dtype queries
METADATA_OPS = {torch.ops.aten.promote_types.default, torch.ops.aten.lift_fresh.default}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, and the host syncs (``aten._local_scalar_dense``) among them.

    ``where=True`` also keeps the Python stack of every sync (frames of hf_dp and transformers, innermost last).
    Nested inside the forward and backward passes (autograd propagates the mode to the backward)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.by_op: collections.Counter = collections.Counter()
        self.where = where
        self.sync_stacks: list[list[str]] = []

    @property
    def kernels(self) -> int:
        """Ops that do work on the data (a kernel launch on a GPU): all but views, aliases and dtype queries."""
        return sum(n for func, n in self.by_op.items() if not (func.is_view or func in METADATA_OPS))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.by_op[func] += 1
        if func is SYNC:
            self.syncs += 1
            if self.where:
                frames = [
                    f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"
                    for f in traceback.extract_stack()[:-1]
                    if ("hf_dp" in f.filename or "transformers" in f.filename or "torch/optim" in f.filename)
                ]
                self.sync_stacks.append(frames[-6:])
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------------- models and data
def build_model(name: str, shape: dict) -> torch.nn.Module:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    h, layers, heads, vocab = shape["hidden"], shape["layers"], shape["heads"], shape["vocab"]
    if name == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab, n_positions=max(128, shape["seq"]), n_embd=h, n_layer=layers, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=(8 * h) // 3, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=max(128, shape["seq"]), tie_word_embeddings=False, pad_token_id=0,
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
    elif name == "bert":
        cfg = BertConfig(
            vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * h, max_position_embeddings=max(128, shape["seq"]), hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=2, pad_token_id=0,
        )  # fmt: skip
        model = BertForSequenceClassification(cfg)
    else:
        raise ValueError(name)
    return model.train()


class Examples(torch.utils.data.Dataset):
    """Random token sequences (full length), causal-LM labels or a class label."""

    def __init__(self, n: int, shape: dict, classification: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, shape["vocab"], (n, shape["seq"]), generator=g)
        self.classes = torch.randint(0, 2, (n,), generator=g)
        self.classification = classification

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}
        if self.classification:
            item["token_type_ids"] = torch.zeros_like(self.ids[i])
            item["labels"] = self.classes[i]
        else:
            item["labels"] = self.ids[i]
        return item


def collate(features: list[dict]) -> dict:
    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def per_example_loss(model, batch: dict) -> torch.Tensor:
    from hf_dp.losses import causal_lm_loss

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    if batch["labels"].dim() == 1:
        return torch.nn.functional.cross_entropy(out.logits, batch["labels"], reduction="none")
    return causal_lm_loss(out.logits, batch["labels"], reduction="sum")


# ---------------------------------------------------------------------------------------------------- engine
def measure_engine(model_name: str, shape: dict, variant: str | None, *, repeats: int, where: bool = False) -> dict:
    """One micro-batch (forward, loss, backward): ops and syncs of the whole and of the backward, median time."""
    from hf_dp import BookKeepingClipper

    model = build_model(model_name, shape)
    data = Examples(shape["batch"], shape, classification=model_name == "bert")
    batch = collate([data[i] for i in range(shape["batch"])])
    clipper = None
    if variant is not None:
        mode, style = VARIANTS[variant]
        clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode, clipping_style=style)

    def micro_batch(counter: OpCounter | None = None, backward_counter: OpCounter | None = None):
        with counter if counter is not None else contextlib.nullcontext():
            loss = per_example_loss(model, batch)
            with backward_counter if backward_counter is not None else contextlib.nullcontext():
                if clipper is None:
                    loss.sum().backward()
                else:
                    clipper.backward(loss)

    for _ in range(2):  # the first micro-batch of a plan proves it
        micro_batch()
    model.zero_grad(set_to_none=True)
    whole, backward_only = OpCounter(where=where), OpCounter()
    micro_batch(whole)
    micro_batch(None, backward_only)
    calls, hf_dp_calls = python_calls(micro_batch)
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        micro_batch()
        times.append(time.perf_counter() - start)
    if clipper is not None:
        clipper.remove()
    return {"ops": whole.ops, "kernels": whole.kernels, "syncs": whole.syncs, "bwd_ops": backward_only.ops,
            "bwd_syncs": backward_only.syncs, "time": min(times), "stacks": whole.sync_stacks,
            "calls": calls, "hf_dp_calls": hf_dp_calls}  # fmt: skip


def python_calls(fn) -> tuple[int, int]:
    """Python function calls (``cProfile``'s count, builtins included) of one ``fn()``, all and those of hf_dp's own
    functions: exact and deterministic, where a tiny width's step time is mostly this Python."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(fn)
    stats = pstats.Stats(profile).stats
    ours = sum(calls for (path, _, _), (_, calls, _, _, _) in stats.items() if f"{os.sep}hf_dp{os.sep}" in path)
    return sum(calls for _, calls, _, _, _ in stats.values()), ours


# ---------------------------------------------------------------------------------------------------- trainer
def measure_trainer(model_name: str, shape: dict, variant: str | None, *, repeats: int, where: bool = False) -> dict:
    """One optimizer step with accumulation 2 (DPTrainer, or Trainer if ``variant`` is None): ops and syncs of the
    step and of its first micro-batch; best step time over ``repeats`` steps."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    warmup, counted = 2, 1
    steps = warmup + counted + repeats + 1  # the last step only closes the timing window of the one before
    model = build_model(model_name, shape)
    data = Examples(512, shape, classification=model_name == "bert")

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.step = 0
            self.counter: OpCounter | None = None
            self.micro: tuple[int, int] | None = None
            self.result: OpCounter | None = None
            self.times: list[float] = []
            self.start = None

        def on_step_begin(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
                self.result, self.counter = self.counter, None
            if self.start is not None and self.step > warmup + counted:
                self.times.append(now - self.start)
            self.step += 1
            if self.step == warmup + 1:
                self.counter = OpCounter(where=where)
                self.counter.__enter__()
            self.start = time.perf_counter()

        def on_substep_end(self, args, state, control, **kwargs):
            if self.counter is not None and self.micro is None:
                self.micro = (self.counter.ops, self.counter.syncs)

    probe = Probe()
    common = dict(
        per_device_train_batch_size=shape["batch"], gradient_accumulation_steps=2, learning_rate=1e-4,
        max_steps=steps, logging_steps=10**6, save_strategy="no", report_to="none", use_cpu=True,
        dataloader_pin_memory=False, disable_tqdm=True, seed=0, max_grad_norm=0.0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if variant is None:
            trainer = Trainer(
                model=model, args=TrainingArguments(out, **common), train_dataset=data, data_collator=collate,
                callbacks=[probe],
            )  # fmt: skip
        else:
            mode, style = VARIANTS[variant]
            args = DPTrainingArguments(
                out, **common, noise_multiplier=1.0, noise_seed=0, per_sample_max_grad_norm=1.0,
                clipping_mode=mode, clipping_style=style,
            )  # fmt: skip
            trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[probe])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    counter = probe.result
    return {"ops": counter.ops, "kernels": counter.kernels, "syncs": counter.syncs, "mb_ops": probe.micro[0],
            "mb_syncs": probe.micro[1], "time": min(probe.times), "stacks": counter.sync_stacks,
            "by_op": counter.by_op}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    p.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--what", nargs="+", default=["engine", "trainer"], choices=["engine", "trainer"])
    p.add_argument("--repeats", type=int, default=7, help="timed micro-batches (engine) / steps (trainer); best kept")
    p.add_argument("--where", action="store_true", help="print the Python stack of every host sync counted")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import transformers

    transformers.logging.set_verbosity_error()
    import logging

    logging.getLogger("hf_dp").setLevel(logging.ERROR)
    print(
        f"# {platform.machine()}, {os.cpu_count()} cpus, {torch.get_num_threads()} torch thread(s), python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(
        "# what\twidth\tmodel\tvariant\tops/mb\tsyncs/mb\tops/step\tsyncs/step\tops x\tkernels x\tsyncs (vs "
        "non-private)\ttime x\t(time)\t(engine: backward alone)\t(engine: Python calls per micro-batch)"
    )
    for what in args.what:
        measure = measure_engine if what == "engine" else measure_trainer
        for width in args.widths:
            shape = WIDTHS[width]
            for model_name in args.models:
                base = measure(model_name, shape, None, repeats=args.repeats, where=args.where)
                _print(what, width, model_name, "non-private", base, base, args.where)
                for variant in args.variants:
                    if what == "trainer" and VARIANTS[variant][0] == "ghost":
                        continue  # DPTrainer refuses ghost mode (two backward passes: a benchmark baseline only)
                    try:
                        r = measure(model_name, shape, variant, repeats=args.repeats, where=args.where)
                    except Exception as error:  # one variant's refusal does not stop the table
                        print(f"{what}\t{width}\t{model_name}\t{variant}\tFAILED: {type(error).__name__}: {error}")
                        continue
                    _print(what, width, model_name, variant, r, base, args.where)
                sys.stdout.flush()


def _print(what, width, model_name, variant, r, base, where) -> None:
    if what == "engine":
        mb = (r["ops"], r["syncs"])
        step = ("-", "-")
        extra = (
            f"\tbwd {r['bwd_ops']} ops ({r['bwd_ops'] / base['bwd_ops']:.2f}x), {r['bwd_syncs']} syncs"
            f"\t{r['calls']} Python calls ({r['hf_dp_calls']} in hf_dp)"
        )
    else:
        mb = (r["mb_ops"], r["mb_syncs"])
        step = (r["ops"], r["syncs"])
        extra = ""
    print(
        f"{what}\t{width}\t{model_name}\t{variant}\t{mb[0]}\t{mb[1]}\t{step[0]}\t{step[1]}\t"
        f"{r['ops'] / base['ops']:.2f}x\t{r['kernels'] / base['kernels']:.2f}x\t{r['syncs']} vs {base['syncs']}"
        f"\t{r['time'] / base['time']:.2f}x\t({r['time'] * 1000:.1f} ms){extra}"
    )
    if where:
        for stack in collections.Counter(tuple(s) for s in r["stacks"]).most_common():
            frames, n = stack
            print(f"    {n} x sync at: " + " <- ".join(reversed(frames)))


if __name__ == "__main__":
    main()
