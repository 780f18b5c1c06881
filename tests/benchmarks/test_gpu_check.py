"""benchmarks/gpu_check.py cannot rot silently: its CPU smoke mode (``--device cpu --tiny``) runs in a subprocess and
every measurement it promises is either made or skipped with a reason; the largest-batch search is checked on a fake
predicate and, through a simulated OOM, end to end on the CPU."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load()


def run(*argv, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def records(stdout):
    """The measurement lines (tab-separated key=value, ``max_batch>=N`` for a bound) as dicts."""
    out = []
    for line in stdout.splitlines():
        if not line.startswith("part="):
            continue
        record = {}
        for field in line.split("\t"):
            key, _, value = field.partition("=")
            if key.endswith(">"):  # max_batch>=N
                key, value = key[:-1], ">=" + value
            record[key] = value
        out.append(record)
    return out


def find(recs, **fields):
    hits = [r for r in recs if all(r.get(k) == v for k, v in fields.items())]
    assert len(hits) == 1, (fields, recs)
    return hits[0]


class TestTinyCpuRun:
    def test_every_measurement_is_made_or_skipped_with_a_reason(self, tmp_path):
        out_json = tmp_path / "gpu_check.json"
        stdout = run("--device", "cpu", "--tiny", "--out", str(out_json))
        recs = records(stdout)
        for model in gpu_check.MODELS:
            for variant in gpu_check.VARIANTS:
                r = find(recs, part="speed", model=model, variant=variant)
                if variant in ("non-private", "hf_dp-bk-mixopt"):
                    assert r["status"] == "ok", r
                assert r["status"] in ("ok", "skipped"), r
                if r["status"] == "ok":
                    assert float(r["step_ms"]) > 0 and float(r["tokens_per_s"]) > 0 and "peak_mb" in r, r
                else:
                    assert r["reason"], r
        bf16 = find(recs, part="precision", precision="bf16")
        assert bf16["status"] == "ok" and 0 <= float(bf16["rel_update_diff"]) < 0.1, bf16
        fp16 = find(recs, part="precision", precision="fp16")
        assert fp16["status"] == "skipped" and fp16["reason"], fp16
        maxbatch = find(recs, part="maxbatch")
        assert maxbatch["status"] == "skipped" and maxbatch["reason"], maxbatch
        assert "| model | variant | step time (x non-private) |" in stdout
        assert "| small | non-private | 1.00 |" in stdout
        assert "\n# machine: " in stdout
        data = json.loads(out_json.read_text())
        assert len(data["records"]) == len(recs)
        assert {"torch", "transformers", "gpu"} <= set(data["machine"])
        assert any(row["variant"] == "hf_dp-bk-mixopt" and row["time_x"] > 0 for row in data["summary"])

    def test_fp16_and_the_oom_search_on_cpu(self):
        stdout = run(
            "--device", "cpu", "--tiny", "--parts", "precision", "maxbatch", "--precisions", "fp16",
            "--maxbatch-models", "small", "--variants", "non-private", "hf_dp-bk-mixopt",
            "--max-batch-cap", "64", "--simulate-oom-above", "21",
        )  # fmt: skip
        recs = records(stdout)
        fp16 = find(recs, part="precision", precision="fp16")
        assert fp16["status"] == "ok" and fp16["backoffs"] == "0" and fp16["loss_scale_start"] == "65536", fp16
        assert fp16["dropped_noised"] == "0,0,0", fp16
        for variant in ("non-private", "hf_dp-bk-mixopt"):
            r = find(recs, part="maxbatch", model="small", variant=variant)
            assert (r["status"], r["max_batch"], r["first_fail"], r["stopped"]) == ("ok", "21", "22", "resolution")
        assert "| small | hf_dp-bk-mixopt | - | - | - | 21 | 1.00 |" in stdout


class TestLargestBatch:
    @staticmethod
    def search(limit, *, start=16, cap=4096, resolution=0.05, time_left=lambda: 1e9):
        tried = []

        def fits(b):
            tried.append(b)
            return b <= limit

        return gpu_check.largest_batch(fits, start=start, cap=cap, resolution=resolution, time_left=time_left), tried

    @pytest.mark.parametrize("limit", [16, 37, 100, 1000])
    def test_doubling_then_bisection_to_the_resolution(self, limit):
        result, tried = self.search(limit)
        assert result["stopped"] == "resolution" and result["max_batch"] <= limit < result["first_fail"]
        assert result["first_fail"] - result["max_batch"] <= max(1, int(0.05 * result["max_batch"]))
        doubling = next(i for i, b in enumerate(tried) if b > limit) + 1  # up to the first failure
        assert tried[:doubling] == [16 * 2**k for k in range(doubling)]

    def test_halves_when_the_first_size_fails(self):
        result, tried = self.search(5)
        assert tried[:3] == [16, 8, 4] and result["max_batch"] == 5 and result["first_fail"] == 6

    def test_nothing_fits(self):
        result, tried = self.search(0, start=4)
        assert result["max_batch"] == 0 and tried == [4, 2, 1]

    def test_stops_at_the_cap(self):
        result, tried = self.search(10**6, cap=100)
        assert result["stopped"] == "cap" and result["max_batch"] == 100 and tried[-1] == 100

    def test_stops_when_the_time_is_spent(self):
        clock = iter([1e9, 1e9, 0.0])
        result, tried = self.search(10**6, time_left=lambda: next(clock, 0.0))
        assert result["stopped"] == "time budget" and result["max_batch"] == tried[-1] and len(tried) == 3
        assert result["first_fail"] is None


def _partial_then_hang(args, send):
    send({"partial": True, "max_batch": 64, "first_fail": None, "trials": [[64, True, 0.1]]})
    time.sleep(60)


def _raises(args, send):
    raise ValueError("boom")


def _skips(args, send):
    raise gpu_check.Skip("not here")


def _dies(args, send):
    print("last words", flush=True)
    os._exit(3)


class TestRunJob:
    """Each measurement runs in a forked process: a hang, an error or a crash there is a line, not the end."""

    def run(self, fn, tmp_path, timeout=30):
        args = gpu_check.parse_args(["--device", "cpu", "--tiny"])
        return gpu_check.run_job(fn, {}, timeout=timeout, log_path=str(tmp_path / "job.log"), args=args)

    def test_a_killed_search_keeps_its_last_partial_result(self, tmp_path):
        result = self.run(_partial_then_hang, tmp_path, timeout=2)
        assert result["status"] == "timeout" and result["max_batch"] == 64
        assert result["stopped"] == "killed at the time limit" and result["wall_s"] < 20

    def test_an_error_is_reported_with_its_message(self, tmp_path):
        result = self.run(_raises, tmp_path)
        assert (result["status"], result["reason"]) == ("failed", "ValueError: boom")
        assert "Traceback" in (tmp_path / "job.log").read_text()

    def test_a_skip_says_why(self, tmp_path):
        assert self.run(_skips, tmp_path)["reason"] == "not here"

    def test_a_crash_is_reported_with_the_last_line_of_its_log(self, tmp_path):
        result = self.run(_dies, tmp_path)
        assert result["status"] == "failed" and "exit code 3" in result["reason"] and "last words" in result["reason"]


def test_help_lists_the_parts_and_the_smoke_mode(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--device cpu --tiny" in text and "--out" in text and "--budget-s" in text


def test_tiny_defaults_and_budgets():
    args = gpu_check.parse_args(["--device", "cpu", "--tiny"])
    assert (args.seq, args.batch, args.repeats) == (16, 2, 1)
    full = gpu_check.parse_args([])
    assert (full.device, full.seq, full.batch) == ("cuda", 128, 16)
    assert full.speed_budget_s + full.precision_budget_s <= full.budget_s <= 480
