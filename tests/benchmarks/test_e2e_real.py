"""benchmarks/e2e_real.py cannot rot silently: SST-2 read with plain gzip + csv (what the GPU machine has), its
arguments, the table's ratios and failures, and runs on a tiny BERT built from a config (word-level tokenizer, no
Hub): Trainer and DPTrainer end to end in fresh processes, Opacus's ghost clipping and the largest-batch search in
this one. The real checkpoint and the decoder variants are the benchmark's, not the test's."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_real.py"
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"good bad movie plot dull fun a the was very".split()]
ROWS = [("a good movie", 1), ("the plot was dull", 0), ('" very fun', 1), ("bad , bad", 0)] * 8


def load():
    spec = importlib.util.spec_from_file_location("e2e_real", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


e2e_real = load()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny BERT classifier and its tokenizer in a folder, and an SST-2-shaped data folder of 32 rows."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    root = tmp_path_factory.mktemp("e2e")
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    model_dir = root / "model"
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)  # fmt: skip
    BertForSequenceClassification(cfg).save_pretrained(model_dir)
    BertTokenizer(vocab_file=str(root / "vocab.txt")).save_pretrained(model_dir)
    (root / "data" / "sst2").mkdir(parents=True)
    with gzip.open(root / "data" / "sst2" / "train.tsv.gz", "wt", encoding="utf-8") as f:
        f.write("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in ROWS))
    return root


def test_sst2_read_without_datasets(tiny):
    sentences, labels = e2e_real.read_sst2(str(tiny / "data"), 5)
    assert sentences == [s for s, _ in ROWS[:5]] and labels == [y for _, y in ROWS[:5]]
    assert sentences[2].startswith('"')  # quoting off, as in GLUE's TSVs


def test_arguments():
    cpu = e2e_real.parse_args([])
    assert (cpu.device, cpu.maxbatch, cpu.logical_batch % cpu.micro_batch) == ("cpu", False, 0)
    assert "decoder-dpsft" in cpu.variants and "decoder-sft" not in e2e_real.parse_args(["--no_decoder"]).variants
    cuda = e2e_real.parse_args(["--device", "cuda"])
    assert cuda.maxbatch and cuda.budget_s <= 240 and cuda.logical_batch > cpu.logical_batch
    with pytest.raises(SystemExit):
        e2e_real.parse_args(["--logical_batch", "10", "--micro_batch", "4"])


def test_table_ratios_and_failures():
    args = e2e_real.parse_args(["--device", "cuda"])
    ok = {"status": "ok", "first_step_s": 2.0, "first_step_cpu_s": 1.0, "peak_mb": 100.0, "examples_per_cpu_s": 20.0}
    records = {
        "trainer": {**ok, "examples_per_s": 40.0},
        "dptrainer-bk-mixopt": {
            **ok,
            "examples_per_s": 10.0,
            "examples_per_cpu_s": 5.0,
            "first_step_s": 6.0,
            "first_step_cpu_s": 4.0,
            "peak_mb": 150.0,
        },  # fmt: skip
        "opacus-ghost": {"status": "failed", "reason": "ValueError: boom"},
        "maxbatch:trainer": {"status": "ok", "max_batch": 400, "first_fail": 420, "stopped": "resolution"},
        "maxbatch:bk-mixopt": {"status": "ok", "max_batch": 300, "first_fail": 320, "stopped": "resolution"},
    }
    info = {"commit": "abc1234", "machine": "m", "gpu": "G", "torch": "t", "transformers": "x", "threads": "1"}
    text = e2e_real.table(records, args, info, ["--device", "cuda"])
    assert "| dptrainer-bk-mixopt | 10.0 | 0.25 | 5.0 | 0.25 | 6.00 | 3.00 | 4.00 | 4.00 | 150 | 1.50 |  |" in text
    assert "| opacus-ghost |" + " - |" * 10 + " failed: ValueError: boom |" in text
    assert "| maxbatch:bk-mixopt | 300 | 320 | resolution | 0.75 |" in text
    assert "commit abc1234" in text and "--device cuda" in text


def test_rounds_give_medians_of_the_runs_that_succeeded():
    runs = [{"status": "ok", "examples_per_s": v, "first_step_s": 10 - v, "trainer": "T"} for v in (3.0, 9.0, 5.0)]
    record = e2e_real.median_record([*runs, {"status": "failed", "reason": "x"}])
    assert (record["examples_per_s"], record["first_step_s"], record["rounds"], record["trainer"]) == (5.0, 5.0, 3, "T")
    assert e2e_real.median_record([{"status": "failed", "reason": "x"}])["status"] == "failed"


def test_trainer_and_dptrainer_end_to_end(tiny, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    argv = ["--model_path", str(tiny / "model"), "--data", str(tiny / "data"), "--n_train", "32",
            "--logical_batch", "8", "--micro_batch", "4", "--steps", "3", "--variants", "trainer",
            "dptrainer-bk-mixopt", "--out", str(tmp_path / "e2e.json"), "--md", str(tmp_path / "e2e.md")]  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads((tmp_path / "e2e.json").read_text())["records"]
    for name in ("trainer", "dptrainer-bk-mixopt"):
        r = records[name]
        assert r["status"] == "ok", r
        assert r["steps"] == 3 and r["examples_per_s"] > 0 and r["first_step_s"] > 0 and r["peak_mb"] > 0
        assert r["examples_per_cpu_s"] > 0 and r["first_step_cpu_s"] > 0
    assert records["trainer"]["steady_examples"] == 2 * 8  # fixed batches; DP's are Poisson
    assert "| trainer | " in (tmp_path / "e2e.md").read_text()


def test_opacus_ghost_and_the_largest_batch_search(tiny):
    argv = ["--model_path", str(tiny / "model"), "--data", str(tiny / "data"), "--n_train", "32",
            "--logical_batch", "8", "--micro_batch", "4", "--steps", "2", "--maxbatch_cap", "8"]  # fmt: skip
    args = e2e_real.parse_args(argv)
    found = e2e_real.run_maxbatch(args, "bk-mixopt")
    assert (found["max_batch"], found["stopped"]) == (8, "cap") and [t[0] for t in found["trials"]] == [4, 8]
    pytest.importorskip("opacus")
    result = e2e_real.run_opacus_ghost(args, e2e_real.Clock("cpu"))
    assert result["steps"] == 2 and result["examples_per_s"] > 0
