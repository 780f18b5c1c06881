"""Issue 37: no false guarantee under faults. A run is killed (a real SIGKILL of a child process) at points of a step
and a save, its files are deleted, replaced, edited or copied to another folder; after each, the stated epsilon covers
every noisy step that ran (counted by the child's own optimizer wrapper, never by hf_dp), or the resume refuses, or
the console and the card say what the epsilon leaves out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from helpers.crash import CountingSGD, run_child, steps_run
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args

from hf_dp import DPTrainer
from hf_dp.ledger import LEDGER_NAME, CheckpointDPStateError, read_ledger

dp_accounting = pytest.importorskip("dp_accounting")

DELTA = 1 / 80  # N = 40: delta = 1 / (2N); q = 8 / 40
SAVE = {"save_strategy": "steps", "save_steps": 4}


def rdp(steps: int, sigma: float = 1.0, q: float = 0.2) -> float:
    """Epsilon of ``steps`` noisy steps by dp-accounting (an independent accountant)."""
    from hf_dp.accounting.analysis.rdp import DEFAULT_ORDERS

    accountant = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


def crash(out: str, counter: str, *, steps: int, kill: dict, **args) -> int:
    """A child run of ``steps`` steps killed at ``kill``; returns the steps it ran (its optimizer's count)."""
    run_child({"out": out, "counter": counter, "kill": kill, "args": {"max_steps": steps, **args}})
    return steps_run(counter)


def resumed(out: str, checkpoint=True, **overrides) -> DPTrainer:
    """The run resumed in this process, its optimizer counting into the same counter as the child's (``out/..``)."""
    model = gpt2()
    counter = os.path.join(os.path.dirname(out), "counter")
    trainer = DPTrainer(
        model=model,
        args=dp_args(out, **overrides),
        train_dataset=ToyDataset(40),
        data_collator=collate,
        optimizers=(CountingSGD(model.parameters(), counter, None, lr=0.01), None),
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


def card(trainer: DPTrainer) -> str:
    return " ".join(trainer.dp_model_card_section().replace("> ", "").split())


@pytest.fixture(scope="module")
def killed_after_checkpoint(tmp_path_factory):
    """Six steps, checkpoint-4, SIGKILL at the end of step 6: the pristine folder, copied by each test."""
    root = tmp_path_factory.mktemp("killed")
    out, counter = str(root / "out"), str(root / "counter")
    ran = crash(out, counter, steps=8, kill={"at": "step_end", "step": 6}, **SAVE)
    assert ran == 6 and os.path.isdir(os.path.join(out, "checkpoint-4"))
    assert not os.path.isdir(os.path.join(out, "checkpoint-8"))
    return out


def fresh_copy(source: str, tmp_path) -> str:
    """A copy of the killed run's folder and its counter; returns the copy's output folder."""
    shutil.copytree(source, str(tmp_path / "out"))
    shutil.copy(os.path.join(os.path.dirname(source), "counter"), str(tmp_path / "counter"))
    return str(tmp_path / "out")


# ------------------------------------------------------------------------------------------------ kills
def test_a_kill_after_the_checkpoint_resumes_with_every_step_that_ran(killed_after_checkpoint, tmp_path):
    out = fresh_copy(killed_after_checkpoint, tmp_path)
    trainer = resumed(out, max_steps=8, **SAVE)
    assert trainer.dp_callback.not_covered == []
    ran = steps_run(os.path.join(os.path.dirname(out), "counter"))
    assert ran == 6 + 4  # 6 before the kill, then steps 5..8 again from checkpoint-4
    assert trainer.dp_callback.history == [[1.0, 0.2, ran]]
    assert trainer.epsilon() >= rdp(ran) * (1 - 5e-3)


@pytest.mark.parametrize("kill", [{"at": "optimizer", "step": 3}, {"at": "state_save", "step": 4}])
def test_a_kill_before_any_usable_checkpoint_is_counted_by_the_next_run_in_the_folder(tmp_path, kill):
    """No checkpoint to resume (killed inside step 3, or while checkpoint-4 was written): a new run in the same folder
    counts the steps of the killed one (the error's advice for the broken checkpoint leads there)."""
    out, counter = str(tmp_path / "out"), str(tmp_path / "counter")
    ran = crash(out, counter, steps=8, kill=kill, **SAVE)
    assert ran == kill["step"]
    if kill["at"] == "state_save":
        with pytest.raises(CheckpointDPStateError, match="start over without `resume_from_checkpoint`"):
            resumed(out, max_steps=8, **SAVE)
    trainer = DPTrainer(
        model=gpt2(), args=dp_args(out, max_steps=3), train_dataset=ToyDataset(40), data_collator=collate
    )
    trainer.train()
    assert trainer.dp_callback.carried_steps == ran
    assert trainer.epsilon() >= rdp(ran + 3) * (1 - 5e-3)  # every step the child's optimizer applied, and 3 more
    assert f"counts {ran} of its {ran + 3} noisy steps from earlier runs" in card(trainer)


def test_excluding_earlier_runs_says_so_on_the_console_and_the_card(tmp_path, caplog):
    out, counter = str(tmp_path / "out"), str(tmp_path / "counter")
    ran = crash(out, counter, steps=8, kill={"at": "step_end", "step": 2}, **SAVE)
    trainer = DPTrainer(
        model=gpt2(),
        args=dp_args(out, max_steps=3, earlier_runs="exclude"),
        train_dataset=ToyDataset(40),
        data_collator=collate,
    )
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        trainer.train()
    assert trainer.dp_callback.carried_steps == 0 and trainer.epsilon() == pytest.approx(rdp(3), rel=5e-3)
    assert f"{ran} noisy steps of earlier run" in caplog.text
    text = card(trainer)
    assert "Not covered by the guarantee above" in text and f"{ran} noisy steps of earlier run" in text


# ------------------------------------------------------------------------------------------------ lost ledgers
def test_a_deleted_ledger_is_said_on_the_console_and_the_card(killed_after_checkpoint, tmp_path, caplog):
    out = fresh_copy(killed_after_checkpoint, tmp_path)
    os.remove(os.path.join(out, LEDGER_NAME))
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        trainer = resumed(out, max_steps=8, **SAVE)
    # the checkpoint's own copy proves its 4 steps; steps 5 and 6 (which ran) cannot be known: said, not counted
    assert trainer.dp_callback.history == [[1.0, 0.2, 8]]
    assert "may have taken after its step 4" in caplog.text and "checkpoint-4" in caplog.text
    text = card(trainer)
    assert "Not covered by the guarantee above" in text and "may have taken after" in text
    # the ledger is whole again from the copy: a later resume sees every step from 0
    chain = read_ledger(os.path.join(out, LEDGER_NAME))[trainer.dp_callback.run_id]
    assert chain.steps == 8 and chain.problem is None


def test_a_ledger_replaced_by_another_runs_is_detected(killed_after_checkpoint, tmp_path, caplog):
    out = fresh_copy(killed_after_checkpoint, tmp_path)
    other = str(tmp_path / "other")
    other_run = DPTrainer(
        model=gpt2(), args=dp_args(other, max_steps=2), train_dataset=ToyDataset(40), data_collator=collate
    )
    other_run.train()
    shutil.copy(os.path.join(other, LEDGER_NAME), os.path.join(out, LEDGER_NAME))
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        trainer = resumed(out, max_steps=8, **SAVE)
    notes = " ".join(trainer.dp_callback.not_covered)
    assert "may have taken after" in notes  # steps 5 and 6 of the killed run: not countable, said
    # the other run's 2 steps: its training set cannot be compared (another folder's fingerprint key): said, not counted
    assert trainer.dp_callback.carried_steps == 0 and "2 noisy steps of earlier run" in notes
    assert "Not covered by the guarantee above" in card(trainer)
    assert trainer.epsilon() == pytest.approx(rdp(4 + 4), rel=5e-3)


def test_a_checkpoint_copied_to_another_folder_says_what_it_cannot_count(killed_after_checkpoint, tmp_path):
    target = str(tmp_path / "elsewhere")
    shutil.copytree(os.path.join(killed_after_checkpoint, "checkpoint-4"), os.path.join(target, "checkpoint-4"))
    trainer = resumed(target, checkpoint=os.path.join(target, "checkpoint-4"), max_steps=8)
    assert trainer.dp_callback.history == [[1.0, 0.2, 8]]  # its copy's 4 steps + 4 new
    assert "copied from another folder" in card(trainer)


def test_an_edited_ledger_line_is_detected_and_restored_from_the_checkpoint_copy(killed_after_checkpoint, tmp_path):
    out = fresh_copy(killed_after_checkpoint, tmp_path)
    path = os.path.join(out, LEDGER_NAME)
    with open(path) as f:
        lines = f.readlines()
    record = json.loads(lines[1])
    record["noise_multiplier"] = 5.0  # a lower epsilon for step 2, hash left as it was
    lines[1] = json.dumps(record, sort_keys=True) + "\n"
    with open(path, "w") as f:
        f.writelines(lines)
    (chain,) = read_ledger(path).values()
    assert "line 2" in chain.problem and "edited" in chain.problem
    trainer = resumed(out, max_steps=8, **SAVE)
    assert trainer.dp_callback.history[0] == [1.0, 0.2, 8]  # sigma 1 throughout: the copy's line, not the edit
    assert any("damaged" in n for n in trainer.dp_callback.not_covered)


# ------------------------------------------------------------------------------------------------ edited checkpoints
def _edit_state(checkpoint: str, edit: dict) -> None:
    """Edit the DP state of a checkpoint: ``{"history": ...}`` replaces its history, ``{"plan": {...}}`` fields of its
    saved plan."""
    path = os.path.join(checkpoint, "trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    attributes = state["stateful_callbacks"]["DPCallback"]["attributes"]
    if "history" in edit:
        attributes["history"] = edit["history"]
    attributes["plan"].update(edit.get("plan", {}))
    with open(path, "w") as f:
        json.dump(state, f)


@pytest.mark.parametrize(
    ("edit", "field", "values"),
    [
        ({"history": [[5.0, 0.2, 4]]}, "noise_multiplier", ("5.0", "1.0")),
        ({"history": [[1.0, 0.01, 4]]}, "sample_rate", ("0.01", "0.2")),
        ({"plan": {"max_grad_norm": 0.01}}, "max_grad_norm", ("0.01", "0.1")),
        ({"plan": {"delta": 0.5}}, "delta", ("0.5", "0.0125")),
    ],
)
def test_an_edited_checkpoint_disagreeing_with_the_ledger_is_refused_naming_both_values(
    killed_after_checkpoint, tmp_path, edit, field, values
):
    out = fresh_copy(killed_after_checkpoint, tmp_path)
    _edit_state(os.path.join(out, "checkpoint-4"), edit)
    with pytest.raises(CheckpointDPStateError) as raised:
        resumed(out, max_steps=8, **SAVE)
    text = str(raised.value)
    assert f"{field}={values[0]}" in text and f"{field}={values[1]}" in text and "edited" in text


def test_a_checkpoint_carries_the_ledger_up_to_its_step(killed_after_checkpoint):
    chains = read_ledger(os.path.join(killed_after_checkpoint, "checkpoint-4", LEDGER_NAME))
    (chain,) = chains.values()
    assert chain.steps == 4 and chain.problem is None
    with open(os.path.join(killed_after_checkpoint, "checkpoint-4", "trainer_state.json")) as f:
        attributes = json.load(f)["stateful_callbacks"]["DPCallback"]["attributes"]
    assert attributes["ledger_head"] == chain.head
