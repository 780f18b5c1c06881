"""Issue 26, part B: a run's privacy settings are frozen at train() start; the privacy ledger only grows; a checkpoint's
DP state is checked before a resume trusts it."""

import copy
import json
import logging
import os
import shutil

import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args
from test_resume import rdp_reference
from transformers import TrainerCallback

from hf_dp import DPTrainer
from hf_dp.accounting import epsilon as accounting_epsilon
from hf_dp.ledger import (
    KEY_NAME,
    LEDGER_NAME,
    CheckpointDPStateError,
    data_fingerprint,
    fingerprint_key,
    fingerprint_mismatch,
    ledger_history,
)
from hf_dp.plan.privacy_plan import DPPlan, FrozenSettingsError
from hf_dp.step.noise import NoiseSource
from hf_dp.trainers import mixin as dp_core

DELTA = 1 / 80  # N = 40 in every test here: delta = 1 / (2N); q = 8 / 40


def trainer(out, dataset=None, callbacks=(), cls=DPTrainer, **overrides):
    return cls(
        model=gpt2(),
        args=dp_args(out, **overrides),
        train_dataset=dataset if dataset is not None else ToyDataset(40),
        data_collator=collate,
        callbacks=list(callbacks),
    )


def ledger_lines(out):
    with open(os.path.join(out, LEDGER_NAME), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------------ frozen settings
class ChangeArgs(TrainerCallback):
    """Changes ``field`` of the arguments to ``value`` in event ``event`` once the run has taken ``after`` steps."""

    def __init__(self, event, field, value, after=1):
        self.field, self.value, self.after, self.done = field, value, after, False
        setattr(self, event, self._change)

    def _change(self, args, state, control, **kwargs):
        if state.global_step >= self.after and not self.done:
            setattr(args, self.field, self.value)
            self.done = True
        return control


@pytest.mark.parametrize("event", ["on_step_end", "on_step_begin", "on_substep_end"])
@pytest.mark.parametrize(("field", "value"), [("per_sample_max_grad_norm", 0.01), ("noise_multiplier", 0.1)])
def test_a_change_to_the_dp_arguments_mid_run_raises_before_the_next_noisy_step(tmp_dir, event, field, value):
    """The issue's case: C -> C/10 (or sigma -> sigma/10) at step 1. on_substep_end runs between the micro-batches of
    step 2, after every callback's on_step_begin: the check before the noise catches it."""
    t = trainer(tmp_dir, callbacks=[ChangeArgs(event, field, value)], max_steps=4)
    with pytest.raises(FrozenSettingsError, match=f"`{field}` .* -> {value}"):
        t.train()
    assert t.dp_callback.steps == 1  # the one step taken before the change, no noisy step after it
    assert t.state.global_step == 1
    assert [line["steps"] for line in ledger_lines(tmp_dir)] == [1]


def test_noise_clipper_and_accountant_read_only_the_frozen_plan(tmp_dir, monkeypatch):
    """With the check switched off, a run whose callback changes C and sigma at step 1 trains bit-identically to an
    unchanged run (fixed noise seed), every step's noise std is scale * plan sigma * plan C, and the accountant records
    the plan's sigma: no part of the mechanism reads the arguments once train() started."""
    monkeypatch.setattr(DPPlan, "check_unchanged", lambda self, args, step=None: None)
    stds = []

    class RecordingSource(NoiseSource):
        def normal(self, *, step, shapes, std, device, dtype):
            stds.append(std)
            return super().normal(step=step, shapes=shapes, std=std, device=device, dtype=dtype)

    monkeypatch.setattr(dp_core, "NoiseSource", RecordingSource)
    torch.manual_seed(0)
    init = gpt2().state_dict()
    runs = []
    for name, callbacks in (
        ("plain", []),
        (
            "changed",
            [
                ChangeArgs("on_step_end", "per_sample_max_grad_norm", 0.01),
                ChangeArgs("on_step_end", "noise_multiplier", 0.1),
            ],
        ),
    ):
        stds.clear()
        t = trainer(os.path.join(tmp_dir, name), callbacks=callbacks, max_steps=3)
        t.model.load_state_dict(copy.deepcopy(init))
        t.train()
        runs.append((t, list(stds)))
    (plain, plain_stds), (changed, changed_stds) = runs
    assert changed.args.per_sample_max_grad_norm == 0.01 and changed.args.noise_multiplier == 0.1  # the change happened
    expected = plain.dp_step.loss_weight * 1.0 * 0.1  # w * sigma * C of the plan
    assert len(changed_stds) == 3
    for std in changed_stds:
        assert all(s == pytest.approx(expected, rel=1e-12) for s in std)
    assert changed_stds == plain_stds
    for (key, a), b in zip(changed.model.state_dict().items(), plain.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    assert changed.dp_callback.history == plain.dp_callback.history == [[1.0, 0.2, 3]]
    assert changed.dp_plan.max_grad_norm == 0.1 and changed.dp_plan.noise_multiplier == 1.0


def test_the_plan_carries_every_setting_and_saves_no_secret(tmp_dir):
    t = trainer(tmp_dir, max_steps=1, noise_seed=987654321, clipping_style="layer-wise", clipping_fn="automatic")
    t.train()
    plan = t.dp_plan
    assert (plan.max_grad_norm, plan.clipping_mode, plan.clipping_style, plan.clipping_fn) == (
        0.1,
        "bk-mixopt",
        "layer-wise",
        "automatic",
    )
    assert plan.clipping_kwargs() == {"clipping_style": "layer-wise", "clipping_fn": "automatic", "gamma": 0.01}
    saved = plan.saved()
    assert "settings" not in saved and "noise_seed" not in json.dumps(saved) and "987654321" not in json.dumps(saved)
    plan.check_unchanged(t.args)  # unchanged arguments pass (parsed clipping groups, lists, included)
    t.args.target_delta = 1e-3
    with pytest.raises(FrozenSettingsError, match="target_delta"):
        plan.check_unchanged(t.args)


# ------------------------------------------------------------------------------------------------ the ledger
class LedgerAtLog(TrainerCallback):
    """At every log, the steps the ledger holds (the log leaves the process: the steps must be on disk by then)."""

    def __init__(self, out):
        self.out, self.seen = out, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append((state.global_step, sum(line["steps"] for line in ledger_lines(self.out))))


def test_every_noisy_step_is_in_the_ledger_before_anything_of_its_model_is_logged(tmp_dir):
    seen = LedgerAtLog(tmp_dir)
    t = trainer(tmp_dir, callbacks=[seen], max_steps=4, noise_seed=987654321)
    t.train()
    assert [s for s in seen.seen if s[0] > 0][:4] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    lines = ledger_lines(tmp_dir)
    assert [(line["step"], line["steps"]) for line in lines] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    keys = {"format", "run", "step", "steps", "noise_multiplier", "sample_rate", "num_examples", "data"}  # no time
    keys |= {"max_grad_norm", "delta", "accountant", "unit", "max_examples_per_user", "prev", "hash"}
    keys |= {"mechanism", "bands"}  # the noise mechanism (issue 41)
    assert all(set(line) == keys for line in lines)
    assert {(line["mechanism"], line["bands"]) for line in lines} == {("dp-sgd", 1)}
    assert {line["run"] for line in lines} == {t.dp_callback.run_id}
    key, _ = fingerprint_key(tmp_dir)
    assert {line["data"] for line in lines} == {data_fingerprint(t.train_dataset, key)["rows"]}
    assert {(line["noise_multiplier"], line["sample_rate"], line["num_examples"]) for line in lines} == {(1.0, 0.2, 40)}
    with open(os.path.join(tmp_dir, LEDGER_NAME), encoding="utf-8") as f:
        text = f.read()
    assert "987654321" not in text and "seed" not in text and "loss" not in text
    assert ledger_history([os.path.join(tmp_dir, LEDGER_NAME)], t.dp_callback.run_id) == [[1.0, 0.2, 4]]
    t.train()  # a second train() call continues the same run: the ledger only grows
    assert ledger_history([os.path.join(tmp_dir, LEDGER_NAME)], t.dp_callback.run_id) == [[1.0, 0.2, 8]]


class Pick:
    """compute_metrics whose best value is at the 2nd evaluation (so the best checkpoint is an early one)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, eval_pred):
        self.calls += 1
        return {"pick": 1.0 if self.calls == 2 else 0.0}


@pytest.mark.parametrize("restore_callback_states", [False, True])
def test_resume_after_best_model_kept_and_later_checkpoints_deleted_accounts_every_step(
    tmp_dir, caplog, restore_callback_states
):
    """The issue's case: load_best_model_at_end + save_total_limit=1 + eval every step keeps only checkpoint-2 of 6
    steps; resume_from_checkpoint=True then runs steps 3..6 again. Before the ledger: epsilon dropped from eps(6) to
    eps(2) at the resume and the run ended at eps(6), 10 noisy steps having run. Now: never below eps(6), eps(10)."""
    common = dict(
        max_steps=6,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="pick",
        greater_is_better=True,
        restore_callback_states_from_checkpoint=restore_callback_states,
    )

    def run(**kwargs):
        t = DPTrainer(
            model=gpt2(),
            args=dp_args(tmp_dir, **common),
            train_dataset=ToyDataset(40),
            eval_dataset=ToyDataset(8, seed=1),
            data_collator=collate,
            compute_metrics=Pick(),
        )
        t.train(**kwargs)
        return t

    first = run()
    assert sorted(n for n in os.listdir(tmp_dir) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    eps_first = first.epsilon()
    assert eps_first == pytest.approx(accounting_epsilon(1.0, 0.2, 6, DELTA))
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        resumed = run(resume_from_checkpoint=True)
    assert any(
        "records 6 noisy steps" in r.getMessage() and "checkpoint-2 only 2" in r.getMessage() for r in caplog.records
    )
    logged = [h["epsilon"] for h in resumed.state.log_history if "epsilon" in h and h.get("step", 0) > 2]
    assert logged and min(logged) >= eps_first  # never goes down across the resume
    assert logged[0] == pytest.approx(accounting_epsilon(1.0, 0.2, 7, DELTA))
    assert resumed.dp_callback.history == [[1.0, 0.2, 10]]  # 6 of the first run + 4 after the resume: all that ran
    assert resumed.epsilon() == pytest.approx(accounting_epsilon(1.0, 0.2, 10, DELTA))
    # dp-accounting drops a few low orders it cannot converge on at q=0.2 (warnings): its bound is a little larger
    assert resumed.epsilon() == pytest.approx(rdp_reference([(1.0, 0.2, 10)], DELTA), rel=5e-3)
    assert resumed.epsilon() > 1.2 * accounting_epsilon(1.0, 0.2, 6, DELTA)  # what was accounted before the ledger
    assert resumed.state.log_history[-1]["epsilon"] == pytest.approx(resumed.epsilon())
    assert ledger_history([os.path.join(tmp_dir, LEDGER_NAME)], first.dp_callback.run_id) == [[1.0, 0.2, 10]]


def test_resume_after_a_crash_counts_the_steps_after_the_last_checkpoint(tmp_dir):
    """A run that took 5 steps and saved at 4 (then died): the resume continues from the 5 steps of the ledger."""

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_dir, callbacks=[Crash()], max_steps=6, save_strategy="steps", save_steps=4).train()
    resumed = trainer(tmp_dir, max_steps=6, save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.dp_callback.history == [[1.0, 0.2, 7]]  # 5 + the 2 steps after checkpoint-4


def test_a_budget_resumed_past_the_ledger_is_recalibrated_and_kept(tmp_dir):
    """target_epsilon: the resume knows the 5 steps of the ledger (not the 4 of the checkpoint), recalibrates sigma of
    the 2 remaining steps for them, and ends within the budget, 7 steps accounted."""

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise KeyboardInterrupt

    common = dict(max_steps=6, save_strategy="steps", save_steps=4, noise_multiplier=None, target_epsilon=3.0)
    first = trainer(tmp_dir, callbacks=[Crash()], **common)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    sigma = first.dp_plan.noise_multiplier
    resumed = trainer(tmp_dir, **common)
    resumed.train(resume_from_checkpoint=True)
    (s1, q1, n1), *rest = resumed.dp_callback.history
    assert (s1, q1, n1) == (sigma, 0.2, 5) and sum(n for _, _, n in rest) == 2
    assert rest[0][0] > sigma  # more noise for the rest: the spent privacy is larger than the checkpoint says
    assert resumed.epsilon() <= 3.0
    assert resumed.epsilon() == pytest.approx(rdp_reference([(s1, q1, n1), *rest], DELTA), rel=5e-3)


# ------------------------------------------------------------------------------------------------ checkpoint checks
@pytest.fixture
def two_checkpoints(tmp_dir):
    trainer(tmp_dir, max_steps=4, save_strategy="steps", save_steps=2).train()
    return tmp_dir


def edit_state(checkpoint, edit):
    path = os.path.join(checkpoint, "trainer_state.json")
    with open(path, encoding="utf-8") as f:
        state = json.load(f)
    edit(state)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(state, f)


def dp_attributes(state):
    return state["stateful_callbacks"]["DPCallback"]["attributes"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: dp_attributes(s).update(history=[]), "accounts 0 noisy steps, but .* after 4 optimizer steps"),
        (lambda s: dp_attributes(s).update(history=[[1.0, 0.2, 3]]), "accounts 3 noisy steps"),
        (lambda s: s["stateful_callbacks"]["DPCallback"].update(attributes={}), "lacks history"),
        (lambda s: s["stateful_callbacks"].pop("DPCallback"), "no DPCallback state"),
        (lambda s: dp_attributes(s).update(history=[["x", 0.2, 4]]), "not a list of"),
        (lambda s: dp_attributes(s).pop("data_fingerprint"), "lacks data_fingerprint"),
    ],
)
def test_an_edited_dp_state_is_refused_naming_the_checkpoint_to_use(two_checkpoints, edit, message):
    out = two_checkpoints
    edit_state(os.path.join(out, "checkpoint-4"), edit)
    with pytest.raises(CheckpointDPStateError, match=message) as raised:
        trainer(out, max_steps=6, save_strategy="steps", save_steps=2).train(resume_from_checkpoint=True)
    assert f"Resume from {os.path.join(out, 'checkpoint-2')} instead" in str(raised.value)
    resumed = trainer(out, max_steps=6, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert resumed.dp_callback.steps == 4 + 4  # the ledger's 4 steps, then steps 3..6 again


@pytest.mark.parametrize("damage", ["missing", "invalid"])
def test_a_broken_checkpoint_gives_a_clear_error(two_checkpoints, damage):
    out = two_checkpoints
    path = os.path.join(out, "checkpoint-4", "trainer_state.json")
    if damage == "missing":
        os.remove(path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write('{"global_step": 4, "stateful')
    with pytest.raises(CheckpointDPStateError) as raised:
        trainer(out, max_steps=6).train(resume_from_checkpoint=True)
    text = str(raised.value)
    assert path in text and ("no trainer_state.json" in text if damage == "missing" else "not valid JSON" in text)
    assert f"Resume from {os.path.join(out, 'checkpoint-2')} instead" in text


def test_no_valid_checkpoint_left_says_to_start_a_new_run(two_checkpoints):
    out = two_checkpoints
    shutil.rmtree(os.path.join(out, "checkpoint-2"))
    os.remove(os.path.join(out, "checkpoint-4", "trainer_state.json"))
    with pytest.raises(
        CheckpointDPStateError, match="No other checkpoint .* start over without `resume_from_checkpoint` in the same"
    ):
        trainer(out, max_steps=6).train(resume_from_checkpoint=True)


def test_resume_on_another_training_set_of_the_same_size_is_refused(two_checkpoints):
    with pytest.raises(CheckpointDPStateError, match="different content.*different training set"):
        trainer(two_checkpoints, dataset=ToyDataset(40, seed=1), max_steps=6).train(resume_from_checkpoint=True)


def test_resume_on_another_datasets_dataset_of_the_same_size_is_refused(tmp_dir):
    datasets = pytest.importorskip("datasets")

    def dataset(seed):
        toy = ToyDataset(40, seed=seed)
        rows = [toy[i] for i in range(len(toy))]
        return datasets.Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]}).with_format("torch")

    trainer(tmp_dir, dataset=dataset(0), max_steps=2, save_strategy="steps", save_steps=2).train()
    same = trainer(tmp_dir, dataset=dataset(0), max_steps=3)
    same.train(resume_from_checkpoint=True)  # the same data rebuilt in another process: accepted
    assert same.dp_callback.steps == 3
    with pytest.raises(CheckpointDPStateError, match="different training set"):
        trainer(tmp_dir, dataset=dataset(1), max_steps=3).train(resume_from_checkpoint=True)


# ------------------------------------------------------------------------------------------------ fingerprints
def test_data_fingerprint_follows_content_not_identity_or_format():
    datasets = pytest.importorskip("datasets")
    a, b, c = ToyDataset(40), ToyDataset(40), ToyDataset(40, seed=1)
    assert data_fingerprint(a) == data_fingerprint(b)
    assert fingerprint_mismatch(data_fingerprint(a), data_fingerprint(c)) is not None
    assert "N=40" in fingerprint_mismatch(data_fingerprint(a), data_fingerprint(ToyDataset(41)))
    raw = datasets.Dataset.from_dict({"input_ids": a.ids.tolist()})
    assert data_fingerprint(raw)["rows"] == data_fingerprint(raw.with_format("torch"))["rows"]
    assert data_fingerprint(raw)["datasets"] not in (None, raw._fingerprint)  # keyed, never the raw fingerprint
    edited = datasets.Dataset.from_dict({"input_ids": [[*a.ids[0].tolist()[:-1], 1], *a.ids[1:].tolist()]})
    assert fingerprint_mismatch(data_fingerprint(raw), data_fingerprint(edited)) is not None


def test_fingerprints_are_keyed_by_the_output_folder(tmp_dir):
    """What checkpoints and the ledger hold is a keyed hash: another key (whoever reads a pushed checkpoint without
    the output folder's key) gets an unrelated value, so the hash is no membership oracle."""
    a = ToyDataset(40)
    key, created = fingerprint_key(tmp_dir)
    assert created and fingerprint_key(tmp_dir) == (key, False)
    assert os.path.basename(os.path.join(tmp_dir, KEY_NAME)).startswith("_")  # the Trainer's uploads skip `_*`
    other, _ = fingerprint_key(os.path.join(tmp_dir, "elsewhere"))
    assert data_fingerprint(a, key)["rows"] != data_fingerprint(a, other)["rows"]
    assert data_fingerprint(a, key)["rows"] != data_fingerprint(a)["rows"]
    t = trainer(tmp_dir, max_steps=2)
    t.train()
    saved = json.dumps(t.dp_callback.state())
    assert data_fingerprint(a)["rows"] not in saved and data_fingerprint(t.train_dataset)["rows"] not in saved


def test_resume_in_another_folder_checks_n_only(tmp_dir):
    """A checkpoint copied to a folder without its key: its content hash cannot be compared (warned), N still is."""
    trainer(tmp_dir, max_steps=2, save_strategy="steps", save_steps=2).train()
    moved = os.path.join(tmp_dir, "moved")
    os.makedirs(moved)
    shutil.copytree(os.path.join(tmp_dir, "checkpoint-2"), os.path.join(moved, "checkpoint-2"))
    t = trainer(moved, max_steps=3)
    t.train(resume_from_checkpoint=True)
    assert t.dp_callback.steps == 3


def test_data_fingerprint_of_a_non_deterministic_dataset_is_n_only():
    class Augmented(ToyDataset):
        def __getitem__(self, i):
            return {"input_ids": torch.randint(0, 10, (4,))}

    fingerprint = data_fingerprint(Augmented(40))
    assert fingerprint["rows"] is None and fingerprint["num_examples"] == 40
    assert fingerprint_mismatch(fingerprint, data_fingerprint(ToyDataset(40))) is None  # N only: accepted
