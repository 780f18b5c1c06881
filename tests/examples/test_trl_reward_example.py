"""examples/trl_reward.py (TRL's reward.py with the three-name change) offline: two DP steps on a tiny GPT-2 saved to
disk and a local jsonl of preference pairs, with and without LoRA (the score head trained with the adapter)."""

import json

import pytest
from test_demo import load
from test_examples import PEFT, TRL_TINY, _jsonl, _preference_rows, _tiny_chat_lm


@pytest.mark.parametrize("peft", [[], [*PEFT, "--lora_task_type", "SEQ_CLS"]], ids=["full", "peft"])
def test_reward_trl_script_offline(tmp_path, peft):
    pytest.importorskip("trl")
    model_dir = _tiny_chat_lm(tmp_path / "tiny-gpt2")
    train_file = _jsonl(tmp_path / "pairs.jsonl", _preference_rows(False, n=32))
    out = tmp_path / "out"
    cli = ["--model_name_or_path", str(model_dir), "--train_file", str(train_file), "--output_dir", str(out)]
    report = load("trl_reward").main([*cli, *TRL_TINY, "--gradient_checkpointing", "true", *peft])
    privacy = report["privacy"]
    assert report["task"] == "reward" and privacy["steps_taken"] == 2 and privacy["num_examples"] == 32
    assert privacy["noise_multiplier"] == 1.0 and 0 < privacy["epsilon"] < float("inf")
    assert json.loads((out / "dp_report.json").read_text())["privacy"]["steps_taken"] == 2
    card = (out / "README.md").read_text()
    assert "## Differential privacy" in card and "one preference pair" in card
    saved = {p.name for p in out.iterdir()}
    assert ("adapter_config.json" in saved) == bool(peft)


def test_reward_trl_script_parses_help(capsys):
    pytest.importorskip("trl")
    with pytest.raises(SystemExit) as exit_info:
        load("trl_reward").main(["--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "--train_file" in printed and "--target_epsilon" in printed and "--center_rewards_coefficient" in printed
