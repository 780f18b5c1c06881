"""benchmarks/fsdp_memory.py cannot rot silently: its ``--quick`` mode runs end to end in a subprocess (2 spawned gloo
processes per variant) for DPTrainer under DDP and under FSDP2, every printed line has its fields, and FSDP2 shards the
parameters and AdamW's states between the two processes."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp_memory.py"
COLUMNS = ["variant", "ranks", "peak_rss_MB", "step_ms", "params_per_rank", "steady_rss_MB", "optim_per_rank"]


def run(*argv, timeout=300):
    """The benchmark's stdout (its exit status must be 0: every variant ran)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def table(stdout):
    """The header and the measurement lines: ``{variant: {column: [rank 0 value, rank 1 value]}}``."""
    lines = [line for line in stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0].split() == COLUMNS, lines[0]
    rows = {}
    for line in lines[1:]:
        fields = line.split()
        assert len(fields) == len(COLUMNS), line
        row = {"ranks": int(fields[1])}
        for column, value in zip(COLUMNS[2:], fields[2:], strict=True):
            per_rank = value.split("/")
            assert len(per_rank) == row["ranks"], line
            cast = int if column.endswith("per_rank") else float
            row[column] = [cast(v) for v in per_rank]
        rows[fields[0]] = row
    return rows


def test_quick_run_prints_every_field_and_fsdp2_shards():
    rows = table(run("--quick", "--steps", "3", "--variants", "ddp-dp", "fsdp2-dp"))
    assert sorted(rows) == ["ddp-dp", "fsdp2-dp"]
    for row in rows.values():
        assert row["ranks"] == 2
        assert all(v > 0 for v in row["step_ms"]), row
        assert all(v > 0 for v in row["params_per_rank"] + row["optim_per_rank"]), row
    ddp, fsdp = rows["ddp-dp"], rows["fsdp2-dp"]
    # DDP: every process holds the whole model; FSDP2: each holds a shard, and the shards add up to the model
    assert ddp["params_per_rank"][0] == ddp["params_per_rank"][1]
    for rank in range(2):
        assert fsdp["params_per_rank"][rank] < ddp["params_per_rank"][rank]
        assert fsdp["optim_per_rank"][rank] < ddp["optim_per_rank"][rank]
    assert sum(fsdp["params_per_rank"]) == ddp["params_per_rank"][0]
