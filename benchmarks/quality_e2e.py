"""E2E BLEU on CPU: a small GPT-2 trained from scratch on an E2E subset, untrained vs DP (eps 3, 8) vs non-private.

Shows BLEU rising under DP with what a 2-core CPU can run. The tokenizer is word-level, built from the training
subset (E2E is already space-tokenized), and the model is GPT-2-shaped from a config: nothing is downloaded. The real
setting of Li et al. (2022, Table 2: GPT-2 124M, full E2E, 10 epochs) needs a GPU; see RESULTS.md.

    python benchmarks/quality_e2e.py --train_samples 10000 --epochs 3 --test_samples 100
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "e2e"


def build_tokenizer_and_config(out: Path, train_file: Path, n: int, layers: int, hidden: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    with gzip.open(train_file, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    corpus = [line.replace("||", " || ") for line in lines]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        corpus, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"], min_frequency=2)
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(out)
    GPT2Config(
        vocab_size=len(fast),
        n_positions=128,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        bos_token_id=fast.eos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    ).save_pretrained(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train_samples", type=int, default=10000)
    p.add_argument("--test_samples", type=int, default=100)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--out", default="bench_out/e2e")
    args = p.parse_args(argv)
    out = Path(args.out)
    model_dir = out / "from_config"
    build_tokenizer_and_config(
        model_dir, DATA / "prefix_format" / "train.txt.gz", args.train_samples, args.layers, args.hidden
    )
    common = [
        sys.executable,
        str(ROOT / "examples" / "table_to_text.py"),
        "--model_name_or_path",
        str(model_dir),
        "--from_scratch",
        "--train_file",
        str(DATA / "prefix_format" / "train.txt.gz"),
        "--test_references",
        str(DATA / "grouped_refs" / "test_grouped.jsonl"),
        "--max_train_samples",
        str(args.train_samples),
        "--max_test_samples",
        str(args.test_samples),
        "--num_beams",
        "5",
        "--max_new_tokens",
        "40",
        "--max_length",
        "96",
        "--seed",
        "0",
        "--use_cpu",
        "true",
        "--dataloader_pin_memory",
        "false",
        "--logging_steps",
        "20",
        "--num_train_epochs",
        str(args.epochs),
    ]
    dp = [
        "--per_device_train_batch_size",
        "64",
        "--gradient_accumulation_steps",
        "4",
        "--learning_rate",
        "3e-3",
        "--per_sample_max_grad_norm",
        "0.5",
    ]
    runs = {
        "untrained": [
            "--noise_multiplier",
            "1.0",
            "--learning_rate",
            "0",
            "--max_steps",
            "1",
            "--per_device_train_batch_size",
            "64",
            "--gradient_accumulation_steps",
            "1",
        ],
        "dp-eps3": ["--target_epsilon", "3", *dp],
        "dp-eps8": ["--target_epsilon", "8", *dp],
        "non-private": [
            "--disable_dp",
            "--per_device_train_batch_size",
            "32",
            "--gradient_accumulation_steps",
            "1",
            "--learning_rate",
            "1e-3",
        ],
    }
    print(
        f"# machine: {platform.machine()} {os.cpu_count()} cpus; GPT-2 {args.layers}x{args.hidden} from config, "
        f"word-level vocab; E2E train subset {args.train_samples}, {args.epochs:g} epochs; "
        f"{args.test_samples} test MRs, beam 5, tokenized refs",
        flush=True,
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for name, extra in runs.items():
        run_dir = out / name
        proc = subprocess.run([*common, *extra, "--output_dir", str(run_dir)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"{name}\tFAILED\t{proc.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        r = json.loads((run_dir / "results.json").read_text())
        m, privacy = r["metrics"], r["privacy"]
        line = (
            f"{name}\tBLEU {m['bleu']:.2f}\tROUGE-L {m['rougeL']:.2f}\ttrain {r['train_time_s']:.0f}s\t"
            f"lr={r['learning_rate']}"
        )
        if privacy.get("private"):
            eps = privacy["epsilon"]
            line += (
                f"\teps(rdp)={float(eps['rdp']):.3f}\teps(prv)={float(eps['prv']):.3f}\t"
                f"delta={float(privacy['delta']):.2g}\tsigma={float(privacy['noise_multiplier']):.3f}\t"
                f"steps={privacy['steps']}\tL={privacy['expected_batch_size']}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
