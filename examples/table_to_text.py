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
    # user-level DP over tables: one unit = all the references of one meaning representation (4,862 in E2E's
    # training split, about 9 references each), at most 4 of them in a batch:
    python examples/table_to_text.py ... --privacy_unit user --user_column table --max_examples_per_user 4
    # a CSV train file with an author column (E2E's original `mr,ref` layout plus `author`):
    python examples/table_to_text.py ... --train_file train.csv --privacy_unit user --user_column author \
        --max_examples_per_user 2 --adaptive_clipping true

Defaults follow the paper: C = 0.1, expected batch 1024, learning rate 5e-4 (DP-Adam), 10 epochs, delta = 1/(2N).

User-level DP (``--privacy_unit user --user_column COL --max_examples_per_user k``): the guarantee covers all the
training rows of one user (users Poisson-sampled, at most k rows each, the sum of a user's per-example gradients
clipped as one; N, q and delta = 1/(2N) count users). ``COL`` is either a column of the training data (a CSV column,
a key of a DART entry or of its annotations such as ``source``, a Hub dataset's column), which wins if it exists, or
one derived from the table itself, for the shared E2E/DART files, which name no author:

* ``table``: all references of one table (an E2E meaning representation, a DART triple set). The crowd workers wrote
  several texts for each table; grouping them protects the table's whole contribution (what could single out a
  table, e.g. a rare combination of fields, is then covered however many references it has).
* ``name``: all texts about one entity: the E2E restaurant (``name[...]``: every table and reference about The
  Vaults together), the DART table's subject (the first triple's subject, or the ``[TITLE]`` of a
  ``[TABLECONTEXT]`` table: the Wikipedia table it came from). The strongest unit (entity-level privacy: whether a
  restaurant is in the data at all), but E2E names only 34 restaurants, so the expected batch must stay far below
  34 users.

Grouping by length is off at user level (``--train_sampling_strategy random``: a user's rows share a micro-batch).
"""

from __future__ import annotations

import csv
import gzip
import json
import re
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
    check_user_column,
    end_distributed,
    make_trainer,
    parse_args,
    privacy_report,
    trainable_parameters,
    user_column,
    write_report,
)

SEPARATOR = " ||"

#: The user columns derived from each table (``--user_column``, when the training data has no such column).
DERIVED_USERS = {
    "table": "all references of one table: an E2E meaning representation, a DART triple set",
    "name": "all texts about one entity: the E2E restaurant name[...], the DART table's subject",
}
#: E2E's original field names (``name[...], eatType[...]``) as the MR||ref prefix format writes them.
E2E_FIELDS = {"eatType": "Type", "priceRange": "price", "familyFriendly": "family friendly"}


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
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "E2E 'MR||ref' lines (.gz ok), an E2E-style CSV (columns mr, ref, any others; .gz ok) or DART "
            "json(.gz)."
        },
    )
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


def e2e_prefix_table(mr: str) -> str:
    """An original E2E MR (``name[The Vaults], priceRange[£20-25]``) in the MR||ref prefix layout (``name : The Vaults
    | price : £ 20 - 25``), the one the test references use; on E2E's dev split this gives prefix_format's MRs byte for
    byte."""
    fields = re.findall(r"([^,\[]+)\[([^\]]*)\]", mr)
    if not fields:
        raise ValueError(f"Not an E2E meaning representation (field[value], ...): {mr!r}")

    def value(v: str) -> str:
        return re.sub(r"£(\d+)", r"£ \1", re.sub(r"£(\d+)-(\d+)", r"£ \1 - \2", v))

    return " | ".join(f"{E2E_FIELDS.get(k.strip(), k.strip())} : {value(v)}" for k, v in fields)


def e2e_name(table: str) -> str | None:
    """The restaurant an E2E table is about: ``name : X`` (prefix layout) or ``name[X]`` (original MR)."""
    found = re.search(r"(?:^|\|)\s*name : ([^|]*)", table) or re.search(r"(?:^|,)\s*name\[([^\]]*)\]", table)
    return found.group(1).strip() if found else None


def dart_entity(tripleset) -> str:
    """What a DART triple set is about: its first triple's subject, or for a ``[TABLECONTEXT]`` table (a row of a
    Wikipedia table) the table's ``[TITLE]``."""
    subject = tripleset[0][0]
    if subject == "[TABLECONTEXT]":
        titles = [o for s, p, o in tripleset if s == "[TABLECONTEXT]" and p == "[TITLE]"]
        return titles[0] if titles else subject
    return subject


def load_examples(data: DataArguments) -> list[dict]:
    """Training rows: ``table``, ``ref``, ``entity`` (see :data:`DERIVED_USERS`) and ``fields``, the source's own
    columns (CSV columns, DART entry and annotation keys, Hub columns), where ``--user_column`` is looked up first."""
    if data.dataset_name:
        from datasets import load_dataset

        raw = load_dataset(data.dataset_name)["train"]
        tables = [r["meaning_representation"] for r in raw]
        return [
            {"table": t, "ref": r["human_reference"], "entity": e2e_name(t), "fields": dict(r)}
            for t, r in zip(tables, raw, strict=True)
        ]
    if ".json" in data.train_file:
        with _open(data.train_file) as f:
            entries = json.load(f)
        return [
            {
                "table": dart_table(e["tripleset"]),
                "ref": a["text"],
                "entity": dart_entity(e["tripleset"]),
                "fields": {
                    **{k: v for k, v in e.items() if k not in ("tripleset", "annotations")},
                    **{k: v for k, v in a.items() if k != "text"},
                },
            }
            for e in entries
            for a in e["annotations"]
        ]
    if ".csv" in data.train_file:
        with _open(data.train_file) as f:
            rows = list(csv.DictReader(f))
        if rows and not {"mr", "ref"} <= set(rows[0]):
            raise ValueError(f"{data.train_file}: a CSV train file needs columns `mr` and `ref`, got {list(rows[0])}.")
        tables = [e2e_prefix_table(r["mr"]) for r in rows]
        return [
            {"table": t, "ref": r["ref"], "entity": e2e_name(t), "fields": r} for t, r in zip(tables, rows, strict=True)
        ]
    examples = []
    with _open(data.train_file) as f:
        for line in f:
            if "||" in line:
                table, ref = line.rstrip("\n").split("||", 1)
                examples.append({"table": table.strip(), "ref": ref.strip(), "entity": e2e_name(table), "fields": {}})
    return examples


def load_pairs(data: DataArguments) -> list[tuple[str, str]]:
    """(table, reference) training pairs."""
    return [(e["table"], e["ref"]) for e in load_examples(data)]


def example_users(examples: list[dict], column: str, source: str) -> list:
    """The user of each training row under ``--user_column column``: the source's own column of that name, else the
    derived ``table`` or ``name`` (:data:`DERIVED_USERS`). Fails, naming what there is, before any model is built."""
    available = examples[0]["fields"] if examples else {}
    check_user_column(column, available, source, DERIVED_USERS)
    if column in available:
        for i, e in enumerate(examples):
            if e["fields"].get(column) is None:
                raise ValueError(f"Row {i} of {source} has no `{column}` (--user_column): every row needs a user.")
        return [e["fields"][column] for e in examples]
    if column == "table":
        return [e["table"] for e in examples]
    for i, e in enumerate(examples):
        if e["entity"] is None:
            raise ValueError(
                f"--user_column name: training row {i} of {source} names no entity (no `name : ...` / `name[...]` "
                f"in {e['table']!r}). Use --user_column table, or a column of the training data."
            )
    return [e["entity"] for e in examples]


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
    """Tokenized (table, reference) rows; with ``users``, each row also carries its user under ``user_key`` (the
    ``--user_column`` DPTrainer reads; the collator ignores it)."""

    def __init__(self, pairs, tokenizer, max_length, users=None, user_key: str | None = None):
        self.items = []
        for i, (table, ref) in enumerate(pairs):
            prompt = tokenizer(table + SEPARATOR, add_special_tokens=False)["input_ids"]
            target = tokenizer(" " + ref, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = (prompt + target)[:max_length]
            labels = ([-100] * len(prompt) + target)[:max_length]
            item = {"input_ids": ids, "labels": labels}
            if users is not None:
                item[user_key] = users[i]
            self.items.append(item)

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
    examples = load_examples(data_args)
    if data_args.max_train_samples:
        examples = examples[: data_args.max_train_samples]
    column = user_column(args)  # privacy_unit="user": each row's user, kept on the rows for DPTrainer
    source = data_args.train_file or data_args.dataset_name
    users = None if column is None else example_users(examples, column, source)
    set_seed(args.seed)  # --from_scratch initialization (and LoRA/prefix init) follows --seed
    model = build_model(model_args, tokenizer)
    pairs = [(e["table"], e["ref"]) for e in examples]
    dataset = TableToTextDataset(pairs, tokenizer, data_args.max_length, users=users, user_key=column)
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
