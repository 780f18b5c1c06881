"""A DPTrainer run in a child process that kills itself with SIGKILL at a chosen point, and counts its optimizer steps
independently of hf_dp.

The count is an optimizer wrapper's: before each step is applied, it appends a line to ``counter`` and fsyncs it, so
``steps_run(counter)`` is the number of noisy updates that were applied (or were being applied) when the process died,
whatever hf_dp recorded. Run as ``python -m helpers.crash '<json>'`` from ``tests/`` (``run_child`` does that).

Kill points (``kill``): ``{"at": "step_end", "step": k}`` (after optimizer step k, before anything else of step k+1),
``{"at": "optimizer", "step": k}`` (inside optimizer step k, after its counter line, before the update),
``{"at": "state_save", "step": k}`` (while checkpoint-k is written: its weights are on disk, its trainer_state.json is
not).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CountingSGD(torch.optim.SGD):
    """SGD that records each step (fsynced) before applying it, and dies where it is told to."""

    def __init__(self, params, counter: str, kill: dict | None, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.counter, self.kill, self.count = counter, kill or {}, 0

    def step(self, closure=None):
        self.count += 1
        with open(self.counter, "a") as f:
            f.write(f"{self.count}\n")
            f.flush()
            os.fsync(f.fileno())
        if self.kill.get("at") == "optimizer" and self.kill.get("step") == self.count:
            _die()
        return super().step(closure)


def train(config: dict) -> None:
    from transformers import TrainerCallback, TrainerState

    from helpers.models import gpt2
    from helpers.trainer import ToyDataset, collate, dp_args
    from hf_dp import DPTrainer
    from hf_dp.release.filter import ReleasedTrainerState

    kill = config.get("kill") or {}

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if kill.get("at") == "step_end" and state.global_step == kill.get("step"):
                _die()

    if kill.get("at") == "state_save":
        for cls in (TrainerState, ReleasedTrainerState):  # hf_dp's state class writes only released statistics
            original = cls.save_to_json

            def save_to_json(self, json_path, original=original):
                if os.path.basename(os.path.dirname(json_path)) == f"checkpoint-{kill['step']}":
                    _die()
                return original(self, json_path)

            cls.save_to_json = save_to_json
    torch.manual_seed(config.get("seed", 0))
    model = gpt2()
    optimizer = CountingSGD(model.parameters(), config["counter"], kill, lr=0.01)
    args = dp_args(config["out"], **config.get("args", {}))
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=ToyDataset(config.get("n", 40), seed=config.get("data_seed", 0)),
        data_collator=collate,
        callbacks=[Kill()],
        optimizers=(optimizer, None),
    )
    trainer.train(resume_from_checkpoint=config.get("resume"))
    with open(os.path.join(config["out"], "child_result.json"), "w") as f:
        json.dump({"epsilon": trainer.epsilon(), "steps": trainer.dp_callback.steps}, f)


def run_child(config: dict, *, expect_kill: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run :func:`train` with ``config`` in a child process; check that it was killed by SIGKILL (or exited 0)."""
    path = os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-m", "helpers.crash", json.dumps(config)],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    expected = -signal.SIGKILL if expect_kill else 0
    assert result.returncode == expected, (result.returncode, result.stderr[-4000:])
    return result


def steps_run(counter: str) -> int:
    """Optimizer steps the child applied or was applying (the independent count)."""
    if not os.path.exists(counter):
        return 0
    with open(counter) as f:
        return sum(1 for line in f if line.strip())


if __name__ == "__main__":
    train(json.loads(sys.argv[1]))
