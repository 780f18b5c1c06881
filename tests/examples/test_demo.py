import importlib.util
import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_demo_runs_offline_and_writes_a_dp_card(tmp_path, capsys):
    demo = load("demo")
    out = tmp_path / "demo"
    code = demo.main(
        [
            "--output_dir",
            str(out),
            "--num_train_examples",
            "200",
            "--num_train_epochs",
            "1",
            "--per_device_train_batch_size",
            "20",
            "--n_layer",
            "1",
            "--n_embd",
            "32",
            "--logging_steps",
            "2",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "Before training:" in printed and "After training:" in printed and "epsilon" in printed
    card = (out / "README.md").read_text()
    assert "## Differential privacy" in card and "differential-privacy" in card
    assert os.path.exists(out / "model.safetensors") and os.path.exists(out / "tokenizer.json")
