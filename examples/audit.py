"""Privacy audit of DP fine-tuning (``hf_dp.audit``), fully offline: does each run leak less than its epsilon says?

Trains the same small causal LM on a generated restaurant data set plus canaries (random token sequences, each
included with probability 1/2) once without privacy (``transformers.Trainer``) and once per target epsilon
(``DPTrainer``), then audits each run with the one-run lower bound of Steinke, Nasr and Jagielski (2023) and the
exposure of Carlini et al. (2019), and prints one table (also written to ``<output_dir>/audit_results.json``).

    python examples/audit.py --output_dir audit_output                   # offline default, ~2-3 min on 2 CPUs
    python examples/audit.py --output_dir out --epsilons 1,8 --num_canaries 500
    python examples/audit.py --output_dir out --model_name_or_path gpt2  # a pretrained model (Hub or local path)

A lower bound above the claimed epsilon means the claim is false (a bug that drops the noise or under-clips). A
bound far below the claim is expected and proves nothing about it: the audit is a lower bound from one run and a
black-box attack.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restaurant_data import make_dataset  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.audit import CanaryAudit, CausalLMCanaries, candidate_token_ids  # noqa: E402


@dataclass
class AuditArguments:
    output_dir: str = field(default="audit_output", metadata={"help": "Where audit_results.json is written."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained causal LM (Hub id or path). None: a small GPT-2 from config."}
    )
    epsilons: str = field(default="1,4,8", metadata={"help": "Comma-separated target epsilons of the DP runs."})
    non_private: bool = field(default=True, metadata={"help": "Also audit a non-private run (transformers.Trainer)."})
    num_train_examples: int = field(default=250, metadata={"help": "Generated restaurant examples (not canaries)."})
    num_canaries: int = field(default=500, metadata={"help": "Canaries m; each is trained on with probability 1/2."})
    canary_length: int = field(default=10, metadata={"help": "Random tokens per canary (the secret)."})
    num_alternatives: int = field(
        default=1000, metadata={"help": "Random secrets each canary is ranked among for exposure (max log2(n+1))."}
    )
    significance: float = field(default=0.05, metadata={"help": "Level of the audit's test."})
    target_delta: float = field(default=1e-5, metadata={"help": "delta of every DP run and of every bound."})
    num_train_epochs: float = field(default=40, metadata={"help": "Epochs of every run."})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "Micro-batch size."})
    gradient_accumulation_steps: int = field(default=2, metadata={"help": "Micro-batches per (expected) step."})
    learning_rate: float = field(default=5e-3, metadata={"help": "AdamW learning rate (constant)."})
    per_sample_max_grad_norm: float = field(default=1.0, metadata={"help": "C of the DP runs."})
    n_layer: int = field(default=2, metadata={"help": "Layers of the from-config model."})
    n_embd: int = field(default=64, metadata={"help": "Hidden size of the from-config model."})
    max_length: int = field(default=48, metadata={"help": "Tokens per training example (truncation)."})
    seed: int = field(default=0, metadata={"help": "Seed of the model, data, canaries and inclusion bits."})


def word_level_tokenizer(corpus: list[str]):
    """A tokenizer built from the corpus itself: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


def encode(texts: list[str], tokenizer, max_length: int) -> list[dict[str, torch.Tensor]]:
    """``<eos> text <eos>``, loss on every token after the first."""
    items = []
    for text in texts:
        ids = [tokenizer.eos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        ids = torch.tensor(ids[:max_length])
        items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return items


class PadCollator:
    """Right-pads ``input_ids`` (pad id), ``attention_mask`` (0) and ``labels`` (-100) to the longest item."""

    def __init__(self, pad_token_id: int) -> None:
        self.fill = {"input_ids": pad_token_id, "attention_mask": 0, "labels": -100}

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        return {
            key: torch.stack([torch.nn.functional.pad(f[key], (0, longest - len(f[key])), value=v) for f in features])
            for key, v in self.fill.items()
        }


def build_model(audit_args: AuditArguments, tokenizer):
    torch.manual_seed(audit_args.seed)
    if audit_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(audit_args.model_name_or_path)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=audit_args.max_length,
        n_embd=audit_args.n_embd,
        n_layer=audit_args.n_layer,
        n_head=4,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def training_arguments(audit_args: AuditArguments, epsilon: float | None) -> TrainingArguments:
    common = dict(
        output_dir=os.path.join(audit_args.output_dir, "runs"),
        per_device_train_batch_size=audit_args.per_device_train_batch_size,
        gradient_accumulation_steps=audit_args.gradient_accumulation_steps,
        num_train_epochs=audit_args.num_train_epochs,
        learning_rate=audit_args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        seed=audit_args.seed,
        save_strategy="no",
        report_to="none",
        logging_steps=10_000,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_pin_memory=False,
    )
    if epsilon is None:
        return TrainingArguments(**common)
    return DPTrainingArguments(
        **common,
        target_epsilon=epsilon,
        target_delta=audit_args.target_delta,
        per_sample_max_grad_norm=audit_args.per_sample_max_grad_norm,
    )


def run_setting(audit_args, epsilon, tokenizer, base_items, canaries, collator) -> dict:
    """Trains one model on the base data + the included canaries and audits it."""
    audit = CanaryAudit(canaries, seed=audit_args.seed, num_alternatives=audit_args.num_alternatives)
    args = training_arguments(audit_args, epsilon)
    trainer_cls = Trainer if epsilon is None else DPTrainer
    trainer = trainer_cls(
        model=build_model(audit_args, tokenizer),
        args=args,
        train_dataset=audit.training_set(base_items),
        data_collator=collator,
        callbacks=[audit.callback()],
    )
    start = time.time()
    trainer.train()
    claimed = math.inf if epsilon is None else trainer.epsilon()
    delta = audit_args.target_delta if epsilon is None else trainer.delta
    result = audit.result(claimed_epsilon=claimed, delta=delta, significance=audit_args.significance)
    return {
        "setting": "non-private" if epsilon is None else f"DP, target epsilon {epsilon:g}",
        **result.to_dict(),
        "seconds": round(time.time() - start, 1),
    }


def table(rows: list[dict]) -> str:
    head = f"{'setting':<24} {'claimed eps':>11} {'eps lower bound':>15} {'r':>5} {'v':>5} {'mean exposure':>13}"
    lines = [head, "-" * len(head)]
    for row in rows:
        claimed = "inf" if row["claimed_epsilon"] is None else f"{row['claimed_epsilon']:.3f}"
        exposure = "-" if row["exposure"] is None else f"{row['exposure']:.2f}"
        lines.append(
            f"{row['setting']:<24} {claimed:>11} {row['epsilon_lower_bound']:>15.3f} {row['num_guesses']:>5} "
            f"{row['num_correct']:>5} {exposure:>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    (audit_args,) = HfArgumentParser(AuditArguments).parse_args_into_dataclasses(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    epsilons = [float(e) for e in audit_args.epsilons.split(",") if e.strip()]
    rows_text = [r["table"] + " => " + r["text"] for r in make_dataset(audit_args.num_train_examples, audit_args.seed)]
    if audit_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(audit_args.model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = word_level_tokenizer(rows_text)
    base_items = encode(rows_text, tokenizer, audit_args.max_length)
    # Random secrets from the model's vocabulary after an <eos> prefix, like the start of a training example.
    canaries = CausalLMCanaries(
        audit_args.num_canaries,
        candidate_token_ids(tokenizer),
        audit_args.canary_length,
        prefix_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        seed=audit_args.seed + 1,
    )
    collator = PadCollator(tokenizer.pad_token_id)
    settings = ([None] if audit_args.non_private else []) + epsilons
    print(
        f"Audit: {audit_args.num_train_examples} examples + {audit_args.num_canaries} canaries (each included with "
        f"probability 1/2), {audit_args.num_train_epochs:g} epochs, delta {audit_args.target_delta:g}, significance "
        f"{audit_args.significance:g}; settings: "
        + ", ".join("non-private" if e is None else f"epsilon {e:g}" for e in settings),
        flush=True,
    )
    rows = []
    for epsilon in settings:
        rows.append(run_setting(audit_args, epsilon, tokenizer, base_items, canaries, collator))
        print(f"done: {rows[-1]['setting']} ({rows[-1]['seconds']} s)", flush=True)
    os.makedirs(audit_args.output_dir, exist_ok=True)
    with open(os.path.join(audit_args.output_dir, "audit_results.json"), "w") as f:
        json.dump({"arguments": vars(audit_args), "results": rows}, f, indent=2)
    print("\n" + table(rows))
    print(f"\nWritten to {os.path.join(audit_args.output_dir, 'audit_results.json')}.")
    refuted = [r["setting"] for r in rows if r["claimed_epsilon"] is not None and r["exceeds_claim"]]
    if refuted:
        print(f"WARNING: the lower bound exceeds the claimed epsilon for: {', '.join(refuted)}.")
    return 1 if refuted else 0


if __name__ == "__main__":
    sys.exit(main())
