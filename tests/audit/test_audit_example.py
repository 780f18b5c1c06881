"""examples/audit.py runs offline and writes its table to audit_results.json."""

import importlib.util
import json
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_audit_example_runs_offline(tmp_path, capsys):
    example = load("audit")
    out = tmp_path / "audit"
    code = example.main(
        [
            "--output_dir", str(out), "--num_train_examples", "40", "--num_canaries", "40", "--num_train_epochs", "2",
            "--epsilons", "2", "--num_alternatives", "10", "--n_embd", "16", "--per_device_train_batch_size", "8",
        ]
    )  # fmt: skip
    assert code == 0
    results = json.loads((out / "audit_results.json").read_text())["results"]
    assert [r["setting"] for r in results] == ["non-private", "DP, target epsilon 2"]
    assert results[0]["claimed_epsilon"] is None and 0 < results[1]["claimed_epsilon"] <= 2.0 + 1e-6
    assert all(r["num_canaries"] == 40 and r["num_guesses"] >= r["num_correct"] for r in results)
    printed = capsys.readouterr().out
    assert "eps lower bound" in printed and "non-private" in printed and "DP, target epsilon 2" in printed
