"""What is released, on every path (issue 26, part C): the DP tag only where the DP section is written; every upload of
weights under ``hub_strategy`` carries the DP card of that moment; ``noise_multiplier=0`` writes a card that says there
is no guarantee; an ``eval_dataset`` that is (or overlaps) the training set never selects the release unnoticed.

No test touches the network: every Hub function transformers calls goes to :class:`FakeHub`, which keeps a copy of each
uploaded folder as it was at the upload, and ``huggingface_hub.HfApi`` itself raises if anything reaches it.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import os
import re
import sys

import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args
from test_release import UNRELEASED_KEYS, keys_in

from hf_dp import DPTrainer
from hf_dp.accounting import epsilon as accounted_epsilon
from hf_dp.release.eval_overlap import REFUSE_FRACTION, EvalOverlap, find_eval_overlap, row_digest, selection_settings
from hf_dp.release.model_card import format_bound
from hf_dp.release.model_saves import detach_dp_card

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")


class FakeHub:
    """Stands in for ``transformers.utils.hub.hf_api()`` in every transformers module that imported it."""

    def __init__(self):
        self.uploads: list[dict] = []
        self.repos: list[str] = []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append(repo_id)
        return type("Repo", (), {"repo_id": f"user/{repo_id}"})()

    def upload_folder(self, repo_id, folder_path, path_in_repo=None, ignore_patterns=None, run_as_future=False, **kw):
        files = {}
        for folder, _, names in os.walk(folder_path):
            for name in names:
                rel = os.path.relpath(os.path.join(folder, name), folder_path)
                if any(fnmatch.fnmatch(rel, pattern) for pattern in ignore_patterns or ()):
                    continue
                with open(os.path.join(folder, name), "rb") as f:
                    files[rel] = f.read()
        self.uploads.append({"path_in_repo": path_in_repo or "", "message": kw.get("commit_message"), "files": files})

        class Done:
            def done(self):
                return True

            def result(self):
                return None

        return Done() if run_as_future else None

    def create_commit(self, repo_id, operations, commit_message=None, **kwargs):
        """What `model.push_to_hub` uses (PushToHubMixin._upload_modified_files): the added files, read now."""
        files = {}
        for op in operations:
            source = op.path_or_fileobj
            if isinstance(source, str | os.PathLike):
                with open(source, "rb") as f:
                    files[op.path_in_repo] = f.read()
            else:
                files[op.path_in_repo] = source if isinstance(source, bytes) else source.read()
        self.uploads.append({"path_in_repo": "", "message": commit_message, "files": files})

    def __getattr__(self, name):  # any other Hub call is a test failure, not a network access
        raise AssertionError(f"unexpected Hub call {name}")

    def weight_uploads(self) -> list[dict]:
        return [u for u in self.uploads if any(os.path.basename(f) in WEIGHT_FILES for f in u["files"])]


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub
    import transformers.utils.hub as hub_module

    fake = FakeHub()
    original = hub_module.hf_api
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("transformers") and getattr(module, "hf_api", None) is original:
            monkeypatch.setattr(module, "hf_api", lambda: fake)

    def refuse(*args, **kwargs):
        raise AssertionError("a Hub call went past the fake hf_api")

    for name in ("create_repo", "upload_folder", "upload_file", "create_commit", "model_info", "repo_info"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, refuse)
    return fake


def front_matter_tags(card: str) -> list[str]:
    assert card.startswith("---\n"), card[:80]
    header = card.split("---\n")[1]
    return re.findall(r"^- (\S+)$", header.split("tags:\n", 1)[1], flags=re.M) if "tags:\n" in header else []


def card_row(card: str, name: str) -> str:
    match = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", card, flags=re.M)
    assert match, name
    return match.group(1)


def assert_dp_card_of_step(card: str, trainer: DPTrainer, steps: int) -> None:
    """The card states the privacy spent after ``steps`` noisy steps, and carries the DP tag."""
    assert "## Differential privacy" in card
    assert "differential-privacy" in front_matter_tags(card) and "hf-dp" in front_matter_tags(card)
    assert card_row(card, "Noisy steps") == str(steps)
    plan = trainer.dp_plan
    eps = accounted_epsilon(plan.noise_multiplier, sample_rate=plan.sample_rate, steps=steps, delta=plan.delta)
    assert card_row(card, "Epsilon, RDP accountant") == f"{format_bound(eps)} (proven upper bound)"


def files_under(root: str) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


# ---------------------------------------------------------------------------------- 1. the model's own saves (issue 39)
class TestTheModelsOwnSaves:
    """After train(), the model's own `save_pretrained` and `push_to_hub` write the DP card of that moment (with its
    tags), as `trainer.save_model` does; `output_dir` gets the card at the end of train()."""

    def test_save_pretrained_writes_the_dp_card(self, tmp_dir):
        model = gpt2()
        trainer = DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=2), train_dataset=ToyDataset(40), data_collator=collate
        )
        assert not (model.model_tags or [])  # __init__ tags nothing
        trainer.train()
        assert_dp_card_of_step(open(os.path.join(tmp_dir, "README.md")).read(), trainer, steps=2)  # output_dir
        plain = os.path.join(tmp_dir, "plain")
        model.save_pretrained(plain)
        assert_dp_card_of_step(open(os.path.join(plain, "README.md")).read(), trainer, steps=2)
        assert "model.safetensors" in files_under(plain)
        released = os.path.join(tmp_dir, "released")
        trainer.save_model(released)
        assert_dp_card_of_step(open(os.path.join(released, "README.md")).read(), trainer, steps=2)
        detach_dp_card(model)  # the plain methods back
        model.save_pretrained(os.path.join(tmp_dir, "detached"))
        assert not os.path.exists(os.path.join(tmp_dir, "detached", "README.md"))

    def test_peft_save_pretrained_keeps_peft_card_and_adds_the_dp_section(self, tmp_dir):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(gpt2(), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
        trainer = DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=1), train_dataset=ToyDataset(40), data_collator=collate
        )
        trainer.train()
        adapter = os.path.join(tmp_dir, "adapter")
        model.save_pretrained(adapter)  # what PEFT's example scripts do
        written = files_under(adapter)
        assert "adapter_model.safetensors" in written
        card = written["README.md"].decode()
        assert_dp_card_of_step(card, trainer, steps=1)
        assert "library_name: peft" in card  # PEFT's own card, kept
        model.save_pretrained(tmp_dir)  # into output_dir: PEFT updates the card written at the end of train()
        assert_dp_card_of_step(open(os.path.join(tmp_dir, "README.md")).read(), trainer, steps=1)

    @pytest.mark.parametrize("peft", [False, True])
    def test_push_to_hub_uploads_the_dp_card(self, tmp_dir, hub, peft):
        model = gpt2()
        if peft:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
        trainer = DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=2), train_dataset=ToyDataset(40), data_collator=collate
        )
        trainer.train()
        model.push_to_hub("dp-toy")
        (upload,) = hub.uploads
        assert_dp_card_of_step(upload["files"]["README.md"].decode(), trainer, steps=2)
        weights = "adapter_model.safetensors" if peft else "model.safetensors"
        assert weights in upload["files"]

    def test_a_model_saved_after_an_interrupted_train_states_the_steps_that_ran(self, tmp_dir):
        """train() stopped by an exception after some noisy steps: the card in output_dir and on the model's own save
        covers the steps that ran (counted by the optimizer itself, before each update), not the steps planned."""
        from transformers import TrainerCallback

        class Interrupt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    raise KeyboardInterrupt

        model = gpt2()
        ran = []

        class CountingSGD(torch.optim.SGD):
            def step(self, closure=None):
                ran.append(1)
                return super().step(closure)

        trainer = DPTrainer(
            model=model,
            args=dp_args(tmp_dir, max_steps=8),
            train_dataset=ToyDataset(40),
            data_collator=collate,
            callbacks=[Interrupt()],
            optimizers=(CountingSGD(model.parameters(), lr=0.1), None),
        )
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert len(ran) == 3
        assert_dp_card_of_step(open(os.path.join(tmp_dir, "README.md")).read(), trainer, steps=len(ran))
        saved = os.path.join(tmp_dir, "saved")
        model.save_pretrained(saved)
        assert_dp_card_of_step(open(os.path.join(saved, "README.md")).read(), trainer, steps=len(ran))

    def test_the_model_stays_a_plain_model(self, tmp_dir):
        model = gpt2()
        DPTrainer(
            model=model, args=dp_args(tmp_dir, max_steps=1), train_dataset=ToyDataset(40), data_collator=collate
        ).train()
        clone = copy.deepcopy(model)
        clone.save_pretrained(os.path.join(tmp_dir, "clone"))  # the copy's saves write the card too
        assert "## Differential privacy" in open(os.path.join(tmp_dir, "clone", "README.md")).read()
        torch.save(model, os.path.join(tmp_dir, "model.pt"))
        loaded = torch.load(os.path.join(tmp_dir, "model.pt"), weights_only=False)
        assert type(loaded) is type(model)


# --------------------------------------------------------------------------------------------------- 2. every upload
@pytest.mark.parametrize("hub_strategy", ["every_save", "checkpoint", "all_checkpoints"])
def test_every_upload_of_weights_carries_the_card_of_that_moment(tmp_dir, hub, hub_strategy):
    args = dp_args(
        tmp_dir,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        push_to_hub=True,
        hub_model_id="dp-toy",
        hub_strategy=hub_strategy,
        include_num_input_tokens_seen="all",
    )
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    trainer.train()
    trainer.push_to_hub()
    assert hub.repos == ["dp-toy"]
    with_weights = hub.weight_uploads()
    # two checkpoints, each pushed as output_dir (and, but for every_save, as a checkpoint folder); then the final push
    assert len(with_weights) == (3 if hub_strategy == "every_save" else 5)
    for upload in with_weights:
        prefix = upload["path_in_repo"]
        card_name = os.path.join(prefix, "README.md") if prefix else "README.md"
        files = {os.path.join(prefix, k) if prefix else k: v for k, v in upload["files"].items()}
        assert card_name in files, (upload["message"], sorted(files))
        match = re.match(r"Training in progress, step (\d+)", upload["message"] or "")
        steps = int(match.group(1)) if match else trainer.state.global_step  # the final push: every step
        assert_dp_card_of_step(files[card_name].decode(), trainer, steps)
        if prefix:  # a checkpoint folder: its state is of the same step as its card
            state = json.loads(files[os.path.join(prefix, "trainer_state.json")])
            assert state["global_step"] == steps
        for name, raw in files.items():  # and hf_dp.release.filter's filter still holds on every pushed file
            if name.endswith(".json"):
                for key, value in keys_in(json.loads(raw)):
                    assert key not in UNRELEASED_KEYS or value == 0, (name, key, value)
    steps_seen = sorted({int(m.group(1)) for u in with_weights if (m := re.match(r".*step (\d+)", u["message"] or ""))})
    assert steps_seen == [2, 4]
    if hub_strategy == "all_checkpoints":
        assert {u["path_in_repo"] for u in with_weights} == {"", "checkpoint-2", "checkpoint-4"}
    # the local checkpoints carry the card of their step too
    for step in (2, 4):
        assert_dp_card_of_step(open(os.path.join(tmp_dir, f"checkpoint-{step}", "README.md")).read(), trainer, step)


def test_user_save_model_with_push_to_hub_uploads_the_card(tmp_dir, hub):
    args = dp_args(tmp_dir, max_steps=2, push_to_hub=True, hub_model_id="dp-toy", hub_strategy="end")
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    trainer.train()
    assert hub.uploads == []  # hub_strategy="end": nothing during training
    trainer.save_model()
    (upload,) = hub.weight_uploads()
    assert_dp_card_of_step(upload["files"]["README.md"].decode(), trainer, 2)


# -------------------------------------------------------------------------------------------- 3. noise_multiplier=0
def test_noise_multiplier_zero_writes_a_no_guarantee_card(tmp_dir, hub):
    args = dp_args(
        tmp_dir,
        max_steps=2,
        noise_multiplier=0.0,
        save_strategy="steps",
        save_steps=1,
        push_to_hub=True,
        hub_model_id="dp-toy",
        hub_strategy="every_save",
    )
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    trainer.train()  # checkpoints (and their cards) at steps 1 and 2: no crash
    assert math.isinf(trainer.epsilon())
    trainer.save_model()  # used to raise "Cannot plot epsilon inf" after the weights were written
    trainer.push_to_hub()
    cards = [open(os.path.join(tmp_dir, "README.md")).read()]
    cards += [open(os.path.join(tmp_dir, f"checkpoint-{s}", "README.md")).read() for s in (1, 2)]
    cards += [u["files"]["README.md"].decode() for u in hub.weight_uploads()]
    assert len(cards) == 3 + 4  # pushes: 2 checkpoints, save_model() (push_to_hub=True pushes) and push_to_hub()
    for card in cards:
        assert "no differential-privacy guarantee (noise multiplier 0, epsilon = inf)" in card
        assert card_row(card, "Guarantee").startswith("none: ")
        tags = front_matter_tags(card)
        assert "differential-privacy" not in tags and "no-dp-guarantee" in tags
        assert "epsilon.png" not in card
    assert not os.path.exists(os.path.join(tmp_dir, "epsilon.png"))


# ---------------------------------------------------------------------------------------------- 4. eval on training
class RowList(torch.utils.data.Dataset):
    """A plain map-style dataset of given rows (other object, other row types than the training set's)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def as_lists(dataset, indices):
    return RowList([{k: v.tolist() for k, v in dataset[i].items()} for i in indices])


class TestFindEvalOverlap:
    def test_identity_fingerprint_and_rows(self):
        from datasets import Dataset

        train = ToyDataset(40)
        (same,), _ = find_eval_overlap(train, train)
        assert same.how == "identity" and same.is_training_set and "the same object" in same.describe()

        table = Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6]], "labels": [0, 1, 0]})
        clone = Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6]], "labels": [0, 1, 0]})
        (fingerprint,), _ = find_eval_overlap(table, clone)
        assert fingerprint.how == "fingerprint" and clone is not table

        # a reordered copy of 10 training rows, as Python lists instead of tensors: found by the row hashes
        (rows,), _ = find_eval_overlap(train, as_lists(train, [7, 3, 30, 1, 2, 9, 11, 12, 25, 39]))
        assert (rows.how, rows.rows_found, rows.rows_checked, rows.fraction) == ("rows", 10, 10, 1.0)
        assert rows.is_training_set

        held_out = ToyDataset(40, seed=1)
        assert find_eval_overlap(train, held_out) == ([], [])
        assert find_eval_overlap(train, None) == ([], [])

    def test_duplicates_below_the_threshold_are_not_the_training_set(self):
        train, held_out = ToyDataset(40), ToyDataset(60, seed=1)
        rows = [held_out[i] for i in range(59)] + [train[5]]
        (dup,), _ = find_eval_overlap(train, RowList(rows))
        assert dup.rows_found == 1 and dup.fraction == pytest.approx(1 / 60) and dup.fraction < REFUSE_FRACTION
        assert not dup.is_training_set and "1 of 60 sampled rows of `eval_dataset`" in dup.describe()

    def test_samples_scale_the_fraction_and_name_each_eval_set(self):
        train = ToyDataset(400)
        overlaps, unchecked = find_eval_overlap(
            train,
            {"dev": as_lists(train, range(100)), "test": ToyDataset(20, seed=3), "stream": IterableRows()},
            eval_sample=50,
            max_train_rows=200,
        )
        (dev,) = overlaps
        assert dev.name == "eval_dataset['dev']" and dev.rows_checked == 50 and dev.train_rows_hashed == 200
        assert 0 < dev.rows_found < 50 and dev.fraction == pytest.approx(min(1.0, dev.rows_found / 50 * 2))
        assert dev.is_training_set and "(of 200 sampled)" in dev.describe()
        assert unchecked == ["eval_dataset['stream']"]

    def test_datasets_rows_are_read_from_the_stored_columns(self):
        from datasets import Dataset

        rng = torch.Generator().manual_seed(0)
        table = Dataset.from_dict(
            {
                "input_ids": torch.randint(0, 50, (300, 6), generator=rng).tolist(),
                "text": [f"row {i}" for i in range(300)],
            }
        )
        split = table.train_test_split(test_size=50, seed=0)
        train = split["train"]
        train.set_transform(
            lambda batch: {"input_ids": [[t + int(torch.randint(0, 9, ())) for t in r] for r in batch["input_ids"]]}
        )
        assert find_eval_overlap(train, split["test"]) == ([], [])
        subset = train.select(range(40)).with_format("torch")  # another fingerprint, another format
        (rows,), _ = find_eval_overlap(train, subset)
        assert (rows.how, rows.rows_found, rows.fraction) == ("rows", 40, 1.0)
        as_python = RowList([{"input_ids": r["input_ids"], "text": r["text"]} for r in table.select(range(20))])
        (python,), _ = find_eval_overlap(table, as_python)
        assert python.rows_found == 20

    def test_unreadable_rows_are_reported_unchecked(self):
        class Broken(RowList):
            def __getitem__(self, i):
                raise KeyError(i)

        assert find_eval_overlap(ToyDataset(40), Broken([None] * 5)) == ([], ["eval_dataset"])

    def test_row_digest_ignores_the_container_type(self):
        row = {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor(1)}
        assert row_digest(row) == row_digest({"labels": 1, "input_ids": [1, 2, 3]})
        assert row_digest(row) != row_digest({"labels": 1, "input_ids": [1, 2, 4]})
        assert row_digest(row, ("input_ids",)) == row_digest({"input_ids": (1, 2, 3), "extra": 0}, ("input_ids",))
        assert row_digest({"x": torch.tensor([0.5], dtype=torch.float32)}) == row_digest({"x": [0.5]})
        assert row_digest({"t": "ab"}) != row_digest({"t": ["a", "b"]}) and row_digest([1]) != row_digest([True])


class IterableRows(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": torch.tensor([1])}


def eval_args(tmp_dir, **overrides):
    base = dict(max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1)
    base.update(overrides)
    return dp_args(tmp_dir, **base)


SELECTIONS = {
    "load_best": dict(load_best_model_at_end=True),
    "save_best": dict(save_strategy="best", metric_for_best_model="loss"),
    "plateau": dict(lr_scheduler_type="reduce_lr_on_plateau"),
    "early_stopping": dict(metric_for_best_model="loss"),
}


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("eval_kind", ["same", "subset"])
def test_selection_on_the_training_set_is_refused_before_training(tmp_dir, selection, eval_kind):
    from transformers import EarlyStoppingCallback

    train = ToyDataset(40)
    evaluation = train if eval_kind == "same" else RowList([train[i] for i in range(0, 40, 4)])  # a tenth of it
    callbacks = [EarlyStoppingCallback(early_stopping_patience=1)] if selection == "early_stopping" else None
    trainer = DPTrainer(
        model=gpt2(),
        args=eval_args(tmp_dir, **SELECTIONS[selection]),
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate,
        callbacks=callbacks,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError) as error:
        trainer.train()
    message = str(error.value)
    assert "held-out evaluation split" in message and "un-noised statistics of the training data" in message
    expected = {
        "load_best": "load_best_model_at_end=True",
        "save_best": 'save_strategy="best"',
        "plateau": 'lr_scheduler_type="reduce_lr_on_plateau"',
        "early_stopping": "EarlyStoppingCallback",
    }[selection]
    assert expected in message
    assert ("the same object" in message) == (eval_kind == "same")
    assert trainer.dp_callback.steps == 0 and trainer.state.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert not any(name.startswith("checkpoint-") for name in os.listdir(tmp_dir))


def test_selection_on_held_out_data_trains_and_says_no_overlap(tmp_dir):
    trainer = DPTrainer(
        model=gpt2(),
        args=eval_args(tmp_dir, load_best_model_at_end=True),
        train_dataset=ToyDataset(40),
        eval_dataset=ToyDataset(16, seed=1),
        data_collator=collate,
    )
    trainer.train()
    trainer.save_model()
    card = " ".join(open(os.path.join(tmp_dir, "README.md")).read().split())
    assert "compared with the training set by hf_dp: no overlap found" in card
    assert "overlaps the training set" not in card and "did not compare" not in card
    assert any("eval_loss" in h for h in trainer.state.log_history)


def test_eval_metrics_on_the_training_set_are_withheld_from_every_file(tmp_dir, hub):
    """No selection: evaluating on the training set is allowed; its metrics stay in memory (the logs, `evaluate()`),
    and no written or pushed file holds them (cards, trainer_state.json, *_results.json); every card says so."""
    train = ToyDataset(40)
    args = eval_args(tmp_dir, push_to_hub=True, hub_model_id="dp-toy", hub_strategy="checkpoint")
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=train, eval_dataset=train, data_collator=collate)
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and any("eval_loss" in h for h in trainer.state.log_history)  # in memory
    trainer.save_metrics("eval", metrics)
    trainer.save_state()
    trainer.push_to_hub()
    written = [
        os.path.join(root, name) for root, _, names in os.walk(tmp_dir) for name in names if name.endswith(".json")
    ]
    written += [os.path.join(tmp_dir, "README.md")]
    pushed = [raw.decode() for u in hub.uploads for name, raw in u["files"].items() if name.endswith((".json", ".md"))]
    texts = [open(path).read() for path in written] + pushed
    assert any("trainer_state.json" in path for path in written) and len(pushed) >= 3
    for text in texts:
        assert "eval_loss" not in text and "eval_runtime" not in text
    cards = [u["files"][name].decode() for u in hub.weight_uploads() for name in u["files"] if name == "README.md"]
    assert len(cards) == len(hub.weight_uploads()) >= 3
    for card in cards:
        text = " ".join(card.replace("> ", "").split())
        assert "`eval_dataset` is the training set (the same object). Its metrics (`eval_*`)" in text
        assert "were withheld from the released files" in text
        assert "No un-noised statistic of the training data" in text
        assert "no overlap found" not in text


def test_eval_metrics_on_the_training_set_are_published_on_request(tmp_dir, hub):
    train = ToyDataset(40)
    args = eval_args(tmp_dir, publish_training_metrics=True)
    trainer = DPTrainer(model=gpt2(), args=args, train_dataset=train, eval_dataset=train, data_collator=collate)
    trainer.train()
    trainer.save_model()
    text = " ".join(open(os.path.join(tmp_dir, "README.md")).read().replace("> ", "").split())
    assert "computed, without noise, on training data and are NOT covered by the guarantee" in text
    assert "`eval_loss`" in text  # listed among the published un-noised statistics


def test_duplicates_below_the_threshold_are_recorded_with_the_selection(tmp_dir):
    train, held_out = ToyDataset(40), ToyDataset(60, seed=1)
    evaluation = RowList([held_out[i] for i in range(59)] + [train[5]])
    trainer = DPTrainer(
        model=gpt2(),
        args=eval_args(tmp_dir, max_steps=1, load_best_model_at_end=True),
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate,
    )
    trainer.train()
    trainer.save_model()
    text = " ".join(open(os.path.join(tmp_dir, "README.md")).read().replace("> ", "").split())
    assert "1 of 60 sampled rows of `eval_dataset` are also rows of the training set" in text
    assert "load_best_model_at_end=True used these metrics, so the choice of the released model" in text


def test_selection_settings_lists_every_channel():
    from transformers import EarlyStoppingCallback, TrainingArguments

    args = TrainingArguments(
        output_dir="unused",
        eval_strategy="steps",
        save_strategy="steps",
        load_best_model_at_end=True,
        lr_scheduler_type="reduce_lr_on_plateau",
        report_to="none",
    )
    found = selection_settings(args, [EarlyStoppingCallback()])
    assert found == ["load_best_model_at_end=True", "EarlyStoppingCallback", 'lr_scheduler_type="reduce_lr_on_plateau"']
    plain = TrainingArguments(output_dir="unused", report_to="none")
    assert selection_settings(plain, []) == []
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1, requires_grad=True)]))
    assert selection_settings(plain, [], scheduler) == ["a ReduceLROnPlateau scheduler"]
    assert EvalOverlap("eval_dataset", "rows", 10, 1, 40, 40, 0.1).is_training_set
