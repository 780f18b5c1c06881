"""benchmarks/quality_bandmf.py: the commands it runs (the mechanism and bands passed, the same batch for both) and
its table (mean +- std over the seeds, the banded minus DP-SGD difference at the same epsilon), without training."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_bandmf.py"


def load():
    spec = importlib.util.spec_from_file_location("quality_bandmf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load()


def fake(accuracy, sigma=1.0, steps=40):
    privacy = {"noise_multiplier": sigma, "steps": steps, "epsilon": {"rdp": 3.0, "prv": 2.5}}
    return {"metrics": {"eval_accuracy": accuracy}, "privacy": privacy}


def test_commands_differ_only_in_the_mechanism():
    args = bench.parse(["--bands", "4", "--device", "cuda", "--train_rows", "100"])
    dpsgd = bench.command(args, "m", 3.0, None, 1, "o")
    banded = bench.command(args, "m", 3.0, 4, 1, "o")
    assert banded[: len(dpsgd)] == dpsgd and banded[len(dpsgd) :] == [
        "--noise_mechanism",
        "banded-toeplitz",
        "--noise_bands",
        "4",
    ]
    assert "--use_cpu" not in dpsgd and dpsgd[dpsgd.index("--max_train_samples") + 1] == "100"
    assert dpsgd[dpsgd.index("--head") :] == ["--head", "classification", "--pooling", "mean"]  # the default head


def test_table_states_mean_std_and_the_difference():
    args = bench.parse(["--epsilons", "3", "--bands", "4", "--seeds", "0", "1"])
    runs = {(3.0, None): [fake(0.80), fake(0.82)], (3.0, 4): [fake(0.83), fake(0.85)]}
    table = bench.table(args, runs)
    assert "| 3 | DP-SGD | 81.00 +- 1.41 | - | 2 |" in table
    assert "| 3 | banded Toeplitz, b = 4 | 84.00 +- 1.41 | +3.00 | 2 |" in table
