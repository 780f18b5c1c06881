"""DP fine-tuning of a causal LM for table-to-text (E2E, DART), with generation and BLEU / ROUGE-L.

Full fine-tuning, LoRA (``--lora_r``) or prefix tuning (``--prefix_tokens``); the loss is taken only on the reference
tokens after the separator; test meaning representations are decoded with beam search (``--num_beams 5``) and scored
with sacreBLEU against all references of each MR, and ROUGE-L (best reference). Predictions and scores are written
next to the model.

    # E2E from the local files (the MR||ref format of Li et al. 2022), GPT-2 from the Hub:
    python examples/table_to_text.py --model_name_or_path gpt2 \
        --train_file ../shared/data/e2e/prefix_format/train.txt.gz \
        --test_references ../shared/data/e2e/grouped_refs/test_grouped.jsonl \
        --output_dir out/e2e-eps3 --target_epsilon 3
    # same script, non-private baseline:
    python examples/table_to_text.py ... --disable_dp

Defaults follow the paper: C = 0.1, expected batch 1024, learning rate 5e-4 (DP-Adam), 10 epochs, delta = 1/(2N).
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    COMMON_DEFAULTS,
    PrintEpsilon,
    add_lora,
    end_distributed,
    make_trainer,
    parse_args,
    privacy_report,
    trainable_parameters,
    write_report,
)

SEPARATOR = " ||"


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Causal LM (Hub id or local path)."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's."})
    from_scratch: bool = field(default=False, metadata={"help": "Random init from the config (Li et al.'s baseline)."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "With --from_scratch: config changes, e.g. 'n_layer=2,n_embd=64,n_head=2'."}
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0: full fine-tuning)."})
    lora_alpha: int = field(default=16)
    lora_target_modules: str | None = field(default=None, metadata={"help": "Comma list; default: peft's per model."})
    prefix_tokens: int = field(default=0, metadata={"help": "Prefix-tuning virtual tokens (0: off)."})


@dataclass
class DataArguments:
    train_file: str | None = field(default=None, metadata={"help": "E2E 'MR||ref' lines (.gz ok) or DART json(.gz)."})
    test_references: str | None = field(
        default=None, metadata={"help": "Grouped references: E2E jsonl (mr_prefix_format, refs) or DART json(.gz)."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset instead, e.g. 'e2e_nlg'."})
    use_tokenized_references: bool = field(default=True, metadata={"help": "E2E: score against tokenized refs."})
    max_length: int = field(default=128)
    max_train_samples: int | None = field(default=None)
    max_test_samples: int | None = field(default=None)
    num_beams: int = field(default=5)
    max_new_tokens: int = field(default=64)
    generation_batch_size: int = field(default=16)


def _open(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def dart_table(tripleset) -> str:
    return " | ".join(" : ".join(t) for t in tripleset)


def load_pairs(data: DataArguments) -> list[tuple[str, str]]:
    """(table, reference) training pairs."""
    if data.dataset_name:
        from datasets import load_dataset

        raw = load_dataset(data.dataset_name)["train"]
        return [(r["meaning_representation"], r["human_reference"]) for r in raw]
    if ".json" in data.train_file:
        with _open(data.train_file) as f:
            return [(dart_table(e["tripleset"]), a["text"]) for e in json.load(f) for a in e["annotations"]]
    pairs = []
    with _open(data.train_file) as f:
        for line in f:
            if "||" in line:
                table, ref = line.rstrip("\n").split("||", 1)
                pairs.append((table.strip(), ref.strip()))
    return pairs


def load_references(data: DataArguments) -> list[tuple[str, list[str]]]:
    """(table, all references) per test meaning representation."""
    if ".jsonl" in data.test_references:
        key = "refs_tokenized" if data.use_tokenized_references else "refs"
        with _open(data.test_references) as f:
            rows = [json.loads(line) for line in f]
        return [(r["mr_prefix_format"], r.get(key) or r["refs"]) for r in rows]
    with _open(data.test_references) as f:
        return [(dart_table(e["tripleset"]), [a["text"] for a in e["annotations"]]) for e in json.load(f)]


class TableToTextDataset(torch.utils.data.Dataset):
    def __init__(self, pairs, tokenizer, max_length):
        self.items = []
        for table, ref in pairs:
            prompt = tokenizer(table + SEPARATOR, add_special_tokens=False)["input_ids"]
            target = tokenizer(" " + ref, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = (prompt + target)[:max_length]
            labels = ([-100] * len(prompt) + target)[:max_length]
            self.items.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PadCollator:
    """Right-pads input_ids (pad id), labels (-100) and builds the attention mask."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_id)
        labels = torch.full((len(features), width), -100)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build_model(model_args: ModelArguments, tokenizer):
    if model_args.from_scratch:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        config.vocab_size = max(config.vocab_size, len(tokenizer))
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    if model_args.lora_r and model_args.prefix_tokens:
        raise ValueError("Choose one of `--lora_r` and `--prefix_tokens`.")
    if model_args.lora_r:
        model = add_lora(
            model, model_args.lora_r, model_args.lora_alpha, model_args.lora_target_modules, task_type="CAUSAL_LM"
        )
    elif model_args.prefix_tokens:
        from peft import PrefixTuningConfig, get_peft_model

        model = get_peft_model(
            model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=model_args.prefix_tokens)
        )
    return model


@torch.no_grad()
def generate(model, tokenizer, tables: list[str], data: DataArguments) -> list[str]:
    model.eval()
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    out = []
    for start in range(0, len(tables), data.generation_batch_size):
        chunk = [t + SEPARATOR for t in tables[start : start + data.generation_batch_size]]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        ids = model.generate(
            **enc,
            num_beams=data.num_beams,
            max_new_tokens=data.max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        out += [
            t.strip() for t in tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        ]
    tokenizer.padding_side = "right"
    return out


def score(predictions: list[str], references: list[list[str]]) -> dict[str, float]:
    """sacreBLEU against all references of each table; ROUGE-L F1 against the best reference."""
    import sacrebleu
    from rouge_score import rouge_scorer

    width = max(len(r) for r in references)
    streams = [[r[k] if k < len(r) else None for r in references] for k in range(width)]
    bleu = sacrebleu.corpus_bleu(predictions, streams).score
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = sum(
        max(scorer.score(ref, pred)["rougeL"].fmeasure for ref in refs)
        for pred, refs in zip(predictions, references, strict=True)
    ) / max(1, len(predictions))
    return {"bleu": round(bleu, 2), "rougeL": round(100 * rouge, 2)}


def main(argv=None):
    own = "--per_device_train_batch_size 16 --gradient_accumulation_steps 64 "
    own += "--learning_rate 5e-4 --num_train_epochs 10"
    defaults = [*COMMON_DEFAULTS, *own.split()]
    model_args, data_args, args, disable_dp = parse_args((ModelArguments, DataArguments), defaults, argv)
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pairs = load_pairs(data_args)
    if data_args.max_train_samples:
        pairs = pairs[: data_args.max_train_samples]
    set_seed(args.seed)  # --from_scratch initialization (and LoRA/prefix init) follows --seed
    model = build_model(model_args, tokenizer)
    dataset = TableToTextDataset(pairs, tokenizer, data_args.max_length)
    trainer = make_trainer(
        disable_dp,
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=PadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[PrintEpsilon()],
    )
    trainer.train()
    train_time = time.time() - start
    trainer.save_model(args.output_dir)

    report = {
        "task": "table_to_text",
        "model": model_args.model_name_or_path,
        "from_scratch": model_args.from_scratch,
        "lora_r": model_args.lora_r,
        "prefix_tokens": model_args.prefix_tokens,
        "trainable_parameters": trainable_parameters(model),
        "train_examples": len(dataset),
        "learning_rate": args.learning_rate,
        "epochs": args.num_train_epochs,
        "train_time_s": round(train_time, 1),
        "privacy": privacy_report(trainer),
        "metrics": {},
    }
    if data_args.test_references:
        refs = load_references(data_args)
        if data_args.max_test_samples:
            refs = refs[: data_args.max_test_samples]
        predictions = generate(trainer.model, tokenizer, [t for t, _ in refs], data_args)
        report["metrics"] = score(predictions, [r for _, r in refs])
        report["metrics"]["test_tables"] = len(refs)
        with open(Path(args.output_dir) / "predictions.txt", "w", encoding="utf-8") as f:
            f.write("\n".join(predictions) + "\n")
    report["wall_time_s"] = round(time.time() - start, 1)
    if trainer.is_world_process_zero():
        write_report(args.output_dir, report)
    return report


if __name__ == "__main__":
    main()
    end_distributed()
    sys.exit(0)
