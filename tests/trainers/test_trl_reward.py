"""DPRewardTrainer / DPRewardConfig (TRL reward modelling) on tiny sequence classification models from configs, with the
offline word-level tokenizer of ``tests/trainers/test_trl.py`` (CPU, no Hub).

Exactness as in ``test_trl_dpo.py``: sigma = 0, q = 1, SGD lr = 1, one step: the update is exactly
``-(1/N) sum_i clip(g_i)``, with ``g_i`` the float64 autograd gradient of pair ``i``'s own reward loss, computed here
from the pair alone (the chosen and the rejected sequence each scored in a batch of one, no padding) on the rows TRL
prepared (``trainer.train_dataset``), and C the median norm.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from test_trl import AUTHORS, USER_LEVEL, WORDS, check_user_level_update, lora, sft_args, tokenizer  # noqa: E402
from test_trl_dpo import CHOSEN, PROMPTS, REJECTED, check_dpo_exact_update, preference_data  # noqa: E402

from hf_dp.release.filter import is_released_log_key  # noqa: E402
from hf_dp.trl import DPRewardConfig, DPRewardTrainer  # noqa: E402

#: What TRL's RewardTrainer logs from the training batches (un-noised statistics of the training pairs).
REWARD_STATS = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens")
MARGINS = [0.5, 0.0, 1.0, -0.5, 0.25, 2.0, 0.0, 1.5]


def gpt2_scorer():
    from transformers import GPT2Config, GPT2ForSequenceClassification

    cfg = GPT2Config(
        vocab_size=len(WORDS), n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, summary_first_dropout=0.0, bos_token_id=2, eos_token_id=2, pad_token_id=0, num_labels=1,
    )  # fmt: skip
    return GPT2ForSequenceClassification(cfg)


def llama_scorer():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=2,
        num_labels=1,
    )  # fmt: skip
    return LlamaForSequenceClassification(cfg)


def implicit_prompt_data(margins=False):
    """``chosen``/``rejected`` full texts (the prompt inside them), with a ``margin`` column if asked."""
    data = {"chosen": [p + c for p, c in zip(PROMPTS, CHOSEN, strict=True)]}
    data["rejected"] = [p + r for p, r in zip(PROMPTS, REJECTED, strict=True)]
    if margins:
        data["margin"] = MARGINS
    return Dataset.from_dict(data)


def reward_args(tmp_dir, **overrides):
    """``sft_args``' single SGD step for 8 pairs (``max_length`` is RewardConfig's too)."""
    return sft_args(tmp_dir, DPRewardConfig, **overrides)


def score(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, 0]


def pair_loss(model, row, center=None):
    """Pair ``row``'s own reward loss (TRL's formula for a batch of that pair alone)."""
    chosen, rejected = score(model, row["chosen_ids"]), score(model, row["rejected_ids"])
    loss = -F.logsigmoid(chosen - rejected - row.get("margin", 0.0))
    if center is not None:
        loss = loss + center * (chosen + rejected) ** 2
    return loss


def check_reward_exact_update(trainer, atol=1e-10):
    center = trainer.args.center_rewards_coefficient
    return check_dpo_exact_update(trainer, None, loss=lambda row: pair_loss(trainer.model, row, center), atol=atol)


def store_reward_stats(trainer, stats):
    """TRL's own path for its batch statistics: ``_metrics['train']``, averaged into the next ``log``."""
    trainer.model.train()
    for key in stats:
        trainer._metrics["train"][key].append(1.0)
    trainer.log({"loss": 0.5})


def check_stats_not_written(trainer, stats, output_dir, inject=store_reward_stats):
    """TRL's statistics of the training batches: not logged by a DP step, and, logged anyway through TRL's own path
    (``inject``: as TRL's ``log`` would after its own ``compute_loss``), kept out of the written
    ``trainer_state.json`` by hf_dp's release filter."""
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert train_logs and all("epsilon" in h for h in train_logs)
    assert not any(key in h for h in train_logs for key in stats)
    assert not any(is_released_log_key(key) for key in stats)
    inject(trainer, stats)  # statistics TRL computed from a training batch
    assert all(key in trainer.state.log_history[-1] for key in stats)  # in memory (console, reporters): the user's
    trainer.save_state()
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        written = json.load(f)["log_history"]
    assert written and any("epsilon" in h for h in written)
    assert not any(key in h for h in written for key in [*stats, "loss"])


class TestExactReward:
    def test_explicit_prompt_gpt2_with_gradient_checkpointing(self, float64, tmp_dir):
        torch.manual_seed(0)
        args = reward_args(tmp_dir)
        assert args.gradient_checkpointing and args.dp_self_check  # TRL's default, hf_dp's default
        trainer = DPRewardTrainer(
            model=gpt2_scorer(), args=args, train_dataset=preference_data(), processing_class=tokenizer()
        )
        row = trainer.train_dataset[0]
        assert tokenizer().convert_ids_to_tokens(row["chosen_ids"]) == ["a", "b", "c", "d", "e", "<eos>"]
        check_reward_exact_update(trainer)
        assert trainer.model.transformer.gradient_checkpointing  # it did run checkpointed

    def test_implicit_prompt_llama_with_margins_and_centering(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPRewardTrainer(
            model=llama_scorer(),
            args=reward_args(tmp_dir, center_rewards_coefficient=0.3),
            train_dataset=implicit_prompt_data(margins=True),
            processing_class=tokenizer(),
        )
        assert trainer.train_dataset["margin"] == MARGINS
        # Llama's RMSNorm normalises in float32 even in a float64 model (see test_trl_dpo.py): absolute tolerance
        check_reward_exact_update(trainer, atol=1e-8)

    def test_lora_with_the_score_head_trained(self, float64, tmp_dir):
        from test_trl import perturb_lora_b

        torch.manual_seed(0)
        trainer = DPRewardTrainer(
            model=gpt2_scorer(),
            args=reward_args(tmp_dir),
            train_dataset=preference_data(),
            processing_class=tokenizer(),
            peft_config=lora(task_type="SEQ_CLS", target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
        )
        trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert any("lora" in n for n in trainable) and any("score" in n for n in trainable)  # modules_to_save
        perturb_lora_b(trainer.model)
        frozen = [p.detach().clone() for p in trainer.model.parameters() if not p.requires_grad]
        check_reward_exact_update(trainer)
        after = [p.detach() for p in trainer.model.parameters() if not p.requires_grad]
        assert all(torch.equal(a, b) for a, b in zip(after, frozen, strict=True))


@pytest.mark.parametrize("settings", [{}, {"center_rewards_coefficient": 0.3}], ids=["plain", "centered"])
@pytest.mark.parametrize("margins", [False, True], ids=["no-margin", "margin"])
def test_per_pair_loss_equals_trl_loss_of_the_pair_alone(float64, tmp_dir, settings, margins):
    from trl import RewardTrainer

    torch.manual_seed(0)
    trainer = DPRewardTrainer(
        model=gpt2_scorer(),
        args=reward_args(tmp_dir, **settings),
        train_dataset=implicit_prompt_data(margins=margins),
        processing_class=tokenizer(),
    )
    collator, rows = trainer.data_collator, trainer.train_dataset
    batch = collator([rows[i] for i in range(4)])
    trainer._in_train = True  # training_step's pairing, outside train()
    paired = trainer._pair_batch(batch)
    trainer._in_train = False
    assert paired["input_ids"].shape[:2] == (4, 2) and ("margin" in paired) == margins
    ours = trainer.compute_per_example_loss(trainer.dp_forward(trainer.model, paired), paired)
    assert ours.shape == (4,)
    for i in range(4):
        theirs = RewardTrainer.compute_loss(trainer, trainer.model, collator([rows[i]]))
        torch.testing.assert_close(ours[i], theirs.to(ours.dtype), rtol=1e-6, atol=1e-8)
    theirs = RewardTrainer.compute_loss(trainer, trainer.model, batch)  # TRL's batch loss: the mean of the pairs'
    torch.testing.assert_close(ours.mean(), theirs.to(ours.dtype), rtol=1e-6, atol=1e-8)


def test_user_level_step_is_the_mean_of_clipped_user_sums(float64, tmp_dir):
    """privacy_unit='user': the user column passes through TRL's preparation and the pairing of the batch; one SGD
    step is -(1/U) sum_u clip(sum_{i in u} g_i) over the pairs' own losses (float64); the card names the unit."""
    torch.manual_seed(0)
    data = preference_data().add_column("author", AUTHORS)
    trainer = DPRewardTrainer(
        model=gpt2_scorer(), args=reward_args(tmp_dir, **USER_LEVEL), train_dataset=data, processing_class=tokenizer()
    )
    check_user_level_update(trainer, lambda row: pair_loss(trainer.model, row))
    assert "one user (column `author`)" in trainer.dp_model_card_section()


class TestRewardRuns:
    def test_model_as_a_path_with_noise_and_eval(self, tmp_dir):
        """`model` as a path (loaded as a one-score classifier, as TRL does), noise on, TRL's evaluation; no statistic
        of the training pairs is logged or written; the card's unit is the pair."""
        from transformers import GPT2LMHeadModel

        path = os.path.join(tmp_dir, "tiny")
        lm = gpt2_scorer()
        GPT2LMHeadModel(lm.config).save_pretrained(path)  # a causal LM checkpoint, as users start from
        tokenizer().save_pretrained(path)
        out = os.path.join(tmp_dir, "out")
        args = reward_args(
            out,
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            learning_rate=1e-2,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=1,
            model_init_kwargs={"dtype": "float32"},
        )
        trainer = DPRewardTrainer(
            model=path, args=args, train_dataset=preference_data(), eval_dataset=preference_data()
        )
        assert trainer.model.config.num_labels == 1 and type(trainer.model).__name__ == "GPT2ForSequenceClassification"
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        assert trainer.dp_callback.steps == 2
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
        assert evals and "eval_accuracy" in evals[0]
        check_stats_not_written(trainer, REWARD_STATS, out)
        trainer.save_model()
        readme = open(os.path.join(out, "README.md")).read()
        assert "## Differential privacy" in readme and "one preference pair" in readme
        assert "one training example (one row" not in readme


class TestRewardRefusals:
    def test_activation_offloading_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="activation_offloading=False"):
            reward_args(tmp_dir, activation_offloading=True)

    def test_other_dp_loss_types_are_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="causal_lm"):
            reward_args(tmp_dir, dp_loss_type="classification")

    def test_plain_reward_config_is_refused(self, tmp_dir):
        from trl import RewardConfig

        with pytest.raises(ValueError, match="DPRewardConfig"):
            DPRewardTrainer(
                model=gpt2_scorer(),
                args=RewardConfig(output_dir=tmp_dir, use_cpu=True, report_to="none"),
                train_dataset=preference_data(),
                processing_class=tokenizer(),
            )


def test_lazy_exports():
    import subprocess
    import sys

    code = (
        "import sys, hf_dp; assert 'trl' not in sys.modules; "
        "from hf_dp import DPRewardConfig, DPRewardTrainer; assert 'trl' in sys.modules; "
        "import hf_dp.trainers.reward_trainer as m; assert m.DPRewardTrainer is DPRewardTrainer"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
