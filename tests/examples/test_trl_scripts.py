"""TRL's own installed scripts (``trl/scripts/sft.py``, ``trl/scripts/dpo.py``) with the three-name change applied to
their source at test time, run through their ``__main__`` path offline on a tiny GPT-2 saved to disk (the shared GPT-2
tokenizer, one layer of width 32) and local datasets given as ``--dataset_name <folder with train.jsonl>``.

The change is made on the syntax tree's positions, and asserted to touch exactly the two imports from ``trl`` and the
two uses TRL's scripts have today (the trainer call in ``main``, the config in ``make_parser``'s dataclass types): if
TRL reshapes its scripts, these tests fail saying where, rather than running TRL's non-private trainers.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
GPT2 = SHARED / "tokenizers" / "gpt2"
pytestmark = pytest.mark.skipif(not (GPT2 / "tokenizer.json").exists(), reason="../shared/data/tokenizers/gpt2 absent")

#: The three-name change of each script: TRL's name -> hf_dp's.
CHANGES = {
    "sft": {"SFTConfig": "DPSFTConfig", "SFTTrainer": "DPSFTTrainer"},
    "dpo": {"DPOConfig": "DPDPOConfig", "DPOTrainer": "DPDPOTrainer"},
}
#: Where TRL's scripts use each name today: (enclosing function, what the use is).
EXPECTED_USES = {
    "SFTTrainer": ("main", "call"),
    "SFTConfig": ("make_parser", "dataclass_types"),
    "DPOTrainer": ("main", "call"),
    "DPOConfig": ("make_parser", "dataclass_types"),
}

TINY = ["--max_steps", "2", "--logging_steps", "1", "--use_cpu", "true", "--dataloader_pin_memory", "false"]
TINY += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--bf16", "false"]
TINY += ["--report_to", "none", "--save_strategy", "no", "--max_length", "32", "--seed", "0"]
TINY += ["--per_sample_max_grad_norm", "1.0", "--noise_multiplier", "1.0", "--gradient_checkpointing"]
# two modules: TRL turns a single `--lora_target_modules` into a string, which PEFT matches as a full regex
PEFT = ["--use_peft", "--lora_r", "2", "--lora_alpha", "4", "--lora_target_modules", "c_attn", "c_fc"]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# ---------------------------------------------------------------- the three-name change


def _uses(tree: ast.Module, names) -> list[tuple[str, str, str, ast.Name]]:
    """Every load of one of ``names``: (name, enclosing function, kind of use, node)."""
    found = []
    for function in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
                found.append((node.func.id, function.name, "call", node.func))
            elif (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["dataclass_types"]
                and isinstance(node.value, ast.Tuple)
            ):
                found += [
                    (e.id, function.name, "dataclass_types", e)
                    for e in node.value.elts
                    if isinstance(e, ast.Name) and e.id in names
                ]
    counted = {id(node) for *_, node in found}
    stray = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names and id(n) not in counted]
    assert not stray, f"TRL's script uses {stray} in a place this test does not know: update EXPECTED_USES"
    return found


def three_name_change(source: str, changes: dict[str, str]) -> str:
    """``source`` with each TRL name of ``changes`` imported from ``hf_dp`` instead of ``trl`` (on the import's own
    line, same indentation) and renamed where used. Asserts TRL's script has the shape this expects."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    imports = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "trl" and any(a.name in changes for a in node.names)
    ]
    imported = sorted(a.name for node in imports for a in node.names if a.name in changes)
    assert imported == sorted(changes), f"expected one `from trl import` of each of {sorted(changes)}, got {imported}"
    uses = _uses(tree, changes)
    assert sorted((name, where, kind) for name, where, kind, _ in uses) == sorted(
        (name, *EXPECTED_USES[name]) for name in changes
    ), f"TRL's script uses {[u[:3] for u in uses]}, expected {[(n, *EXPECTED_USES[n]) for n in changes]}"

    edits = []  # (line index, start col, end col, replacement); single-line spans, applied right to left
    for _, _, _, node in uses:
        assert node.lineno == node.end_lineno
        edits.append((node.lineno - 1, node.col_offset, node.end_col_offset, changes[node.id]))
    for node in imports:
        assert node.lineno == node.end_lineno, "a multi-line `from trl import (...)`: update three_name_change"
        kept = [a for a in node.names if a.name not in changes]
        moved = [changes[a.name] for a in node.names if a.name in changes]
        assert all(a.asname is None for a in node.names)
        indent = " " * node.col_offset
        text = f"from trl import {', '.join(a.name for a in kept)}\n{indent}" if kept else ""
        text += f"from hf_dp import {', '.join(moved)}"
        edits.append((node.lineno - 1, node.col_offset, node.end_col_offset, text))
    for row, start, end, text in sorted(edits, reverse=True):
        lines[row] = lines[row][:start] + text + lines[row][end:]
    changed = "".join(lines)
    left = [n.id for n in ast.walk(ast.parse(changed)) if isinstance(n, ast.Name) and n.id in changes]
    assert not left, left
    return changed


def _trl_script(name: str) -> Path:
    spec = importlib.util.find_spec(f"trl.scripts.{name}")
    assert spec is not None and spec.origin, f"trl has no trl/scripts/{name}.py"
    return Path(spec.origin)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, Path]:
    """TRL's installed sft.py and dpo.py with the three-name change, written to a temporary folder."""
    folder = tmp_path_factory.mktemp("trl_scripts")
    out = {}
    for name, changes in CHANGES.items():
        path = folder / f"{name}.py"
        path.write_text(three_name_change(_trl_script(name).read_text(), changes))
        out[name] = path
    return out


def test_the_change_touches_the_imports_and_uses_only(scripts):
    for name, changes in CHANGES.items():
        original = _trl_script(name).read_text().splitlines()
        changed = scripts[name].read_text().splitlines()
        removed = [line for line in original if line not in changed]
        added = [line for line in changed if line not in original]
        # the two `from trl import` lines (less one name each), each followed by its `from hf_dp import`, the two uses
        assert len(removed) == 4 and len(added) == 6, (removed, added)
        moved = sorted(line.strip() for line in added if "hf_dp" in line)
        assert moved == sorted(f"from hf_dp import {ours}" for ours in changes.values())
        text = "\n".join(changed)
        trainer, config = (changes[k] for k in sorted(changes, key=lambda k: k.endswith("Config")))
        assert f"trainer = {trainer}(" in text and f"dataclass_types = (ScriptArguments, {config}," in text
        assert not re.search(rf"\b({'|'.join(changes)})\b", text)


def test_the_change_refuses_a_script_of_another_shape():
    source = "from trl import SFTConfig, SFTTrainer\n\ndef main():\n    t = SFTTrainer(args=SFTConfig())\n"
    with pytest.raises(AssertionError, match="does not know|expected"):
        three_name_change(source, CHANGES["sft"])
    with pytest.raises(AssertionError, match="from trl import"):
        three_name_change("def main():\n    pass\n", CHANGES["sft"])


# ---------------------------------------------------------------- running them


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A one-layer GPT-2 (width 32) with the shared GPT-2 tokenizer and a chat template, saved to a folder."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    config = AutoConfig.from_pretrained(GPT2, n_layer=1, n_embd=32, n_head=2, n_positions=64)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokenizer.chat_template = CHAT_TEMPLATE  # GPT-2 has none; TRL's conversational formats need one
    tokenizer.save_pretrained(folder)
    return folder


WORDS = ["the cat sat", "a dog ran home", "birds sing at dawn", "rain fell on the hills", "we ate bread"]


def _rows(form: str, n: int = 48) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = WORDS[i % 5], WORDS[(i + 2) % 5]
        if form == "text":
            rows.append({"text": f"{a} and then {b}."})
        elif form == "messages":
            rows.append({"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]})
        elif form == "prompt_completion":
            rows.append({"prompt": f"{a}?", "completion": f" {b}."})
        elif form == "preference":
            rows.append({"prompt": f"{a}?", "chosen": f" {b}.", "rejected": f" {WORDS[(i + 4) % 5]}!"})
        elif form == "conversational_preference":
            rows.append(
                {
                    "prompt": [{"role": "user", "content": a}],
                    "chosen": [{"role": "assistant", "content": b}],
                    "rejected": [{"role": "assistant", "content": WORDS[(i + 4) % 5]}],
                }
            )
    return rows


def _dataset_dir(folder: Path, form: str) -> Path:
    """A local folder with ``train.jsonl``: what TRL's ``load_dataset(--dataset_name)`` reads offline."""
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(form)))
    return folder


@pytest.fixture
def trainers(monkeypatch):
    """The trainers the scripts build (``hf_dp``'s classes, each subclassed only to record its instances)."""
    import hf_dp

    built = []
    for name in ("DPSFTTrainer", "DPDPOTrainer"):
        base = getattr(hf_dp, name)
        recording = type(name, (base,), {"__init__": _recording_init(base, built)})
        monkeypatch.setattr(hf_dp, name, recording)
    return built


def _recording_init(base, built):
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        built.append(self)

    return __init__


def run_script(path: Path, argv: list[str], monkeypatch) -> None:
    """TRL's ``if __name__ == "__main__":`` path: parse ``sys.argv`` with the script's parser, then ``main``."""
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    runpy.run_path(str(path), run_name="__main__")


def _check_run(trainers, out: Path, peft: bool, unit: str):
    from peft import PeftModel

    (trainer,) = trainers
    privacy = trainer.dp_summary()
    assert privacy["steps_taken"] == 2 and privacy["noise_multiplier"] == 1.0 and privacy["num_examples"] > 0
    assert 0 < trainer.epsilon() < float("inf")
    assert isinstance(trainer.model, PeftModel) == peft
    model = trainer.model.get_base_model() if peft else trainer.model
    assert trainer.args.gradient_checkpointing and model.is_activation_checkpointing  # on in the model TRL trained
    card = (out / "README.md").read_text()
    assert "## Differential privacy" in card and unit in card
    assert (out / "adapter_config.json").exists() == peft
    return trainer


#: Each of TRL's SFT dataset forms once (each run costs seconds: the datasets fingerprint hashes GPT-2's tokenizer at
#: every map), LoRA on half of them; gradient checkpointing on in all (TRL's default, passed explicitly).
SFT_FORMS = {
    "text": ("text", []),
    "conversational_peft": ("messages", PEFT),
    "completion_only_peft": ("prompt_completion", PEFT),
    "packing_wrapped": ("text", ["--packing", "--packing_strategy", "wrapped"]),
    "packing_bfd": ("text", ["--packing"]),  # TRL's default strategy: padding-free, each sequence clipped alone
}
#: The card's unit line of each kind of run.
UNITS = {
    "packing_wrapped": "one packed row of `max_length` tokens",
    "packing_bfd": "one sequence: one example of the training set",
}


@pytest.mark.parametrize("form", list(SFT_FORMS))
def test_trl_sft_script(tmp_path, monkeypatch, scripts, tiny_model, trainers, form):
    rows, flags = SFT_FORMS[form]
    data, out = _dataset_dir(tmp_path / "data", rows), tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--output_dir", str(out)]
    run_script(scripts["sft"], [*argv, *TINY, *flags], monkeypatch)
    trainer = _check_run(trainers, out, peft="--use_peft" in flags, unit=UNITS.get(form, "one training example"))
    columns = trainer.train_dataset.column_names
    if form == "completion_only_peft":  # TRL's prompt-completion preparation: the loss on the completion only
        assert "labels" in columns and trainer.args.completion_only_loss is not False
        for labels in trainer.train_dataset["labels"]:  # the prompt's tokens masked, the completion's kept
            assert labels[0] == -100 and labels[-1] != -100, labels
    if form == "packing_bfd":  # sampled as the 48 sequences, packed per micro-batch after sampling
        assert trainer.dp_summary()["num_examples"] == 48 and "seq_lengths" not in columns
    if form == "packing_wrapped":  # 48 short rows wrapped into rows of exactly 32 tokens
        lengths = {len(ids) for ids in trainer.train_dataset["input_ids"]}
        assert lengths == {32} or (max(lengths) == 32 and len(lengths) == 2), lengths  # the last row may be short
        assert trainer.dp_summary()["num_examples"] < 48


def test_trl_sft_script_refuses_bfd_split_packing(tmp_path, monkeypatch, scripts, tiny_model, trainers):
    """`bfd_split` (a document's pieces would be clipped as separate examples) is refused while parsing."""
    data = _dataset_dir(tmp_path / "data", "text")
    argv = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match=r"bfd_split.*Set `packing_strategy='bfd'`"):
        run_script(scripts["sft"], [*argv, *TINY, "--packing", "--packing_strategy", "bfd_split"], monkeypatch)
    assert not trainers


#: examples/dpo.py's tests run the other two combinations.
DPO_FORMS = {
    "standard": ("preference", []),
    "conversational_peft": ("conversational_preference", PEFT),
}


@pytest.mark.parametrize("form", list(DPO_FORMS))
def test_trl_dpo_script(tmp_path, monkeypatch, scripts, tiny_model, trainers, form):
    rows, flags = DPO_FORMS[form]
    data, out = _dataset_dir(tmp_path / "data", rows), tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--output_dir", str(out)]
    run_script(scripts["dpo"], [*argv, *TINY, "--beta", "0.5", *flags], monkeypatch)
    trainer = _check_run(trainers, out, peft="--use_peft" in flags, unit="one preference pair")
    assert trainer.dp_summary()["num_examples"] == 48
    if not flags:  # the reference: a frozen copy of the initial policy, untouched by training
        assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
