"""hf_dp demo (``make demo``): DP fine-tuning with DPTrainer on a small table-to-text task, fully offline.

The default generates an E2E-style restaurant data set, builds a word-level tokenizer from it and trains a small
GPT-2 from its config, with (epsilon, delta)-DP; it prints epsilon as training goes, a few generations before and
after, and writes the model, tokenizer and DP model card to ``--output_dir``.

    python examples/demo.py --output_dir demo_output                       # offline default, ~2 min on 2 CPUs
    python examples/demo.py --output_dir out --model_name_or_path gpt2     # a pretrained model (Hub or local path)

For E2E itself (from the Hub or from local files) use ``examples/table_to_text.py``.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from transformers.trainer_callback import PrinterCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restaurant_data import make_dataset  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402

SEPARATOR = " => "


@dataclass
class DemoArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained causal LM (Hub id or path). None: a small GPT-2 from config."}
    )
    num_train_examples: int = field(default=4000, metadata={"help": "Generated training examples."})
    n_layer: int = field(default=2, metadata={"help": "Layers of the from-config model."})
    n_embd: int = field(default=128, metadata={"help": "Hidden size of the from-config model."})
    max_length: int = field(default=48, metadata={"help": "Tokens per example (table + separator + sentence)."})


def word_level_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer built from the corpus itself: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


class CausalTableDataset(torch.utils.data.Dataset):
    """``table => text<eos>``, loss on the text tokens only (the reference after the separator)."""

    def __init__(self, rows, tokenizer, max_length):
        self.items = []
        for row in rows:
            prompt = tokenizer(row["table"] + SEPARATOR, add_special_tokens=False)["input_ids"]
            target = tokenizer(" " + row["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = (prompt + target)[:max_length]
            labels = ([-100] * len(prompt) + target)[:max_length]
            pad = max_length - len(ids)
            self.items.append(
                {
                    "input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
                    "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                    "labels": torch.tensor(labels + [-100] * pad),
                }
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PrintEpsilon(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(
                f"step {state.global_step:4d}/{state.max_steps}  loss {logs['loss']:.3f}  "
                f"epsilon {logs['epsilon']:.3f} ({args.accountant})  "
                + "  ".join(f"{k} {v:.3f}" for k, v in logs.items() if k.startswith("epsilon_")),
                flush=True,
            )


@torch.no_grad()
def generate(model, tokenizer, tables, max_new_tokens=24):
    model.eval()
    outputs = []
    for table in tables:
        ids = tokenizer(table + SEPARATOR, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        outputs.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return outputs


def main(argv=None):
    parser = HfArgumentParser((DemoArguments, DPTrainingArguments))
    defaults = [
        "--output_dir",
        "demo_output",
        "--target_epsilon",
        "8",
        "--per_sample_max_grad_norm",
        "0.5",
        "--per_device_train_batch_size",
        "100",
        "--gradient_accumulation_steps",
        "2",
        "--num_train_epochs",
        "8",
        "--learning_rate",
        "3e-3",
        "--lr_scheduler_type",
        "constant",
        "--warmup_steps",
        "0",
        "--logging_steps",
        "10",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--seed",
        "0",
        "--use_cpu",
        "true",
        "--dataloader_pin_memory",
        "false",
    ]
    argv = sys.argv[1:] if argv is None else argv
    demo_args, args = parser.parse_args_into_dataclasses(defaults + list(argv))
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)

    train_rows = make_dataset(demo_args.num_train_examples, seed=args.seed)
    test_rows = make_dataset(3, seed=args.seed + 1)
    if demo_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(demo_args.model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(demo_args.model_name_or_path)
    else:
        tokenizer = word_level_tokenizer([r["table"] + SEPARATOR + r["text"] for r in train_rows])
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=demo_args.max_length,
            n_embd=demo_args.n_embd,
            n_layer=demo_args.n_layer,
            n_head=4,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = GPT2LMHeadModel(config)
    dataset = CausalTableDataset(train_rows, tokenizer, demo_args.max_length)

    print("Before training:")
    for row, text in zip(test_rows, generate(model, tokenizer, [r["table"] for r in test_rows]), strict=True):
        print(f"  {row['table']}\n    -> {text!r}")

    trainer = DPTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[PrintEpsilon()]
    )
    trainer.remove_callback(PrinterCallback)  # PrintEpsilon prints a shorter line
    print(
        f"\nDP training: N={len(dataset)}, expected batch {trainer.expected_batch_size} (q={trainer.sample_rate:.4f}), "
        f"{trainer.num_dp_steps} steps, sigma={trainer.dp_noise_multiplier:.3f}, C={args.per_sample_max_grad_norm}, "
        f"delta={trainer.delta:.2g}, target epsilon={args.target_epsilon}"
    )
    trainer.train()

    print("\nAfter training:")
    for row, text in zip(test_rows, generate(model, tokenizer, [r["table"] for r in test_rows]), strict=True):
        print(f"  {row['table']}\n    -> {text!r}\n    reference: {row['text']!r}")
    trainer.save_model(args.output_dir)
    eps = {name: trainer.epsilon(name) for name in sorted({args.accountant, *args.epsilon_accountants})}
    print(
        f"\nFinal privacy: ({', '.join(f'{k}: {v:.3f}' for k, v in eps.items())}), delta={trainer.delta:.2g}, "
        f"{trainer.dp_callback.steps} steps. Model and DP model card written to {args.output_dir}/ "
        f"(README.md)."
    )
    return 0 if all(math.isfinite(v) for v in eps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
