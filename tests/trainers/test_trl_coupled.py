"""TRL trainers whose loss couples the examples of a batch (KTO's batch KL estimate, GRPO's and RLOO's group-normalized
advantages) are refused when ``DPTrainerMixin`` is composed with them, at construction, before TRL's ``__init__`` runs,
with the reason and what to use instead (``hf_dp/trainers/coupled.py``, ``docs/trainer_subclasses.md``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

trl = pytest.importorskip("trl")

from test_trl import gpt2, tokenizer  # noqa: E402
from test_trl_dpo import preference_data  # noqa: E402

from hf_dp import DPArgumentsMixin, DPTrainerMixin  # noqa: E402
from hf_dp.trainers.coupled import COUPLED_TRL_TRAINERS, check_trainer_class  # noqa: E402


def compose(trainer_class, config_class):
    """The recipe of docs/trainer_subclasses.md for a TRL trainer."""

    @dataclass
    class DPConfig(DPArgumentsMixin, config_class):
        pass

    class DPTrainer(DPTrainerMixin, trainer_class):
        _dp_arguments_class = DPConfig

    return DPTrainer, DPConfig


def dp_config(tmp_dir, config_class, **overrides):
    return config_class(
        output_dir=tmp_dir, report_to="none", use_cpu=True, bf16=False, noise_multiplier=1.0, dp_loss_type="causal_lm",
        **overrides,
    )  # fmt: skip


def unpaired_data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["a b ", "c d "], "completion": ["e f", "g h"], "label": [True, False]})


def test_kto_is_refused_with_the_batch_kl_and_what_to_use(tmp_dir, monkeypatch):
    from trl import KTOConfig, KTOTrainer

    called = []
    monkeypatch.setattr(KTOTrainer, "__init__", lambda self, *a, **k: called.append(1))
    trainer_class, config_class = compose(KTOTrainer, KTOConfig)
    # KTOConfig's default sequential sampling is refused first, and says why
    with pytest.raises(ValueError, match="KTO's KL term, an estimate over the batch"):
        dp_config(tmp_dir, config_class)
    args = dp_config(tmp_dir, config_class, train_sampling_strategy="random")
    with pytest.raises(ValueError, match="KTOTrainer") as error:
        trainer_class(model=gpt2(), args=args, train_dataset=unpaired_data(), processing_class=tokenizer())
    message = str(error.value)
    assert "KL" in message and "estimated over the batch" in message and "sequential sampling" in message
    assert "DPDPOTrainer" in message and "DPSFTTrainer" in message
    assert not called  # refused before TRL's __init__


def test_grpo_is_refused_with_the_group_advantages_and_what_to_use(tmp_dir, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    called = []
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self, *a, **k: called.append(1))
    trainer_class, config_class = compose(GRPOTrainer, GRPOConfig)
    args = dp_config(tmp_dir, config_class)
    prompts = preference_data().select_columns(["prompt"])
    with pytest.raises(ValueError, match="GRPOTrainer") as error:
        trainer_class(model=gpt2(), reward_funcs=lambda completions, **_: [1.0] * len(completions), args=args,
                      train_dataset=prompts, processing_class=tokenizer())  # fmt: skip
    message = str(error.value)
    assert "group" in message and "standard deviation" in message and "generates" in message
    assert "DPDPOTrainer" in message and "unit of privacy" in message
    assert not called


@pytest.mark.parametrize("name", ["RLOOTrainer", "KTOTrainer", "GRPOTrainer"])
def test_a_subclass_of_a_coupled_trainer_is_refused_by_class(name):
    upstream = getattr(trl, name)
    user_class = type("MyTrainer", (DPTrainerMixin, type("Custom", (upstream,), {})), {})
    with pytest.raises(ValueError, match=f"TRL's `{name}` \\(`MyTrainer` derives from it\\)"):
        check_trainer_class(user_class)


def test_the_experimental_grpo_variants_are_refused():
    from trl.experimental.gmpo import GMPOTrainer  # a GRPOTrainer subclass

    with pytest.raises(ValueError, match="GRPOTrainer"):
        check_trainer_class(GMPOTrainer)


def test_the_per_pair_trl_trainers_are_not_refused():
    from hf_dp.trl import DPCPOTrainer, DPDPOTrainer, DPORPOTrainer, DPRewardTrainer, DPSFTTrainer

    for cls in (DPSFTTrainer, DPDPOTrainer, DPRewardTrainer, DPORPOTrainer, DPCPOTrainer):
        check_trainer_class(cls)
    assert set(COUPLED_TRL_TRAINERS) == {"KTOTrainer", "GRPOTrainer", "AsyncGRPOTrainer", "RLOOTrainer"}
