"""DPORPOTrainer / DPORPOConfig (TRL's ORPO, ``trl.experimental.orpo``) on tiny models from configs, with the offline
word-level tokenizer of ``tests/trainers/test_trl.py`` (CPU, no Hub).

Exactness as in ``test_trl_dpo.py``: sigma = 0, q = 1, SGD lr = 1, one step: the update is exactly
``-(1/N) sum_i clip(g_i)``, with ``g_i`` the float64 autograd gradient of pair ``i``'s own ORPO loss, computed here from
the pair alone (its chosen and its rejected sequence each in a batch of one, no padding) on the rows TRL prepared
(``trainer.train_dataset``: ``chosen_input_ids``, ``chosen_labels`` with the prompt labelled -100, ...), with the
paper's formula (``log(1 - p)`` written out), and C the median norm.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from test_trl import (  # noqa: E402
    AUTHORS,
    USER_LEVEL,
    check_user_level_update,
    gpt2,
    llama,
    lora,
    perturb_lora_b,
    sft_args,
    tokenizer,
)
from test_trl_dpo import check_dpo_exact_update, conversational_preference_data, preference_data  # noqa: E402
from test_trl_reward import check_stats_not_written  # noqa: E402

from hf_dp.trl import DPORPOConfig, DPORPOTrainer  # noqa: E402

#: What TRL's ORPOTrainer logs from the training batches (un-noised statistics of the training pairs).
ORPO_STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/rejected",
    "logps/chosen",
    "logits/rejected",
    "logits/chosen",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
)


def orpo_args(tmp_dir, **overrides):
    """``sft_args``' single SGD step for 8 pairs, with beta large enough that the odds-ratio term matters."""
    return sft_args(tmp_dir, DPORPOConfig, **{"beta": 0.5, **overrides})


def token_log_probs(model, ids):
    """Log-probability of each next token of one sequence (a batch of one, no padding): ``[T - 1]``."""
    ids = torch.tensor(ids)[None]
    logps = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1], dim=-1)
    return logps.gather(-1, ids[0, 1:, None])[:, 0]


def completion_mean(model, row, side):
    """The average log-probability of the pair's ``side`` completion tokens (labels not -100) and all next tokens."""
    tokens = token_log_probs(model, row[f"{side}_input_ids"])
    completion = torch.tensor(row[f"{side}_labels"][1:]) != -100
    return tokens[completion].mean(), tokens


def pair_loss(model, row, beta, reduction="mean"):
    """Pair ``row``'s own ORPO loss (the paper's Eq. 6-7: NLL of the chosen sequence minus beta log sigmoid(log OR))."""
    chosen, chosen_tokens = completion_mean(model, row, "chosen")
    rejected, _ = completion_mean(model, row, "rejected")
    log_odds = (chosen - torch.log(1 - torch.exp(chosen))) - (rejected - torch.log(1 - torch.exp(rejected)))
    nll = -(chosen_tokens.mean() if reduction == "mean" else chosen_tokens.sum())
    return nll - beta * F.logsigmoid(log_odds)


def check_orpo_exact_update(trainer, atol=1e-10):
    args = trainer.args
    loss = lambda row: pair_loss(trainer.model, row, args.beta, args.per_example_loss_reduction)  # noqa: E731
    return check_dpo_exact_update(trainer, None, loss=loss, atol=atol)


class TestExactORPO:
    def test_standard_full_model_with_gradient_checkpointing(self, float64, tmp_dir):
        torch.manual_seed(0)
        args = orpo_args(tmp_dir)
        assert args.gradient_checkpointing and args.dp_self_check  # TRL's default, hf_dp's default
        trainer = DPORPOTrainer(model=gpt2(), args=args, train_dataset=preference_data(), processing_class=tokenizer())
        row = trainer.train_dataset[0]
        assert tokenizer().convert_ids_to_tokens(row["chosen_input_ids"]) == ["a", "b", "c", "d", "e", "<eos>"]
        assert row["chosen_labels"][:2] == [-100, -100]  # the prompt is not a completion token
        check_orpo_exact_update(trainer)
        assert trainer.model.transformer.gradient_checkpointing  # it did run checkpointed

    def test_conversational_llama_summed_nll(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPORPOTrainer(
            model=llama(),
            args=orpo_args(tmp_dir, per_example_loss_reduction="sum"),
            train_dataset=conversational_preference_data(),
            processing_class=tokenizer(),
        )
        row = trainer.train_dataset[0]
        assert tokenizer().convert_ids_to_tokens(row["prompt_input_ids"])[:2] == ["user", ":"]
        # Llama's RMSNorm normalises in float32 even in a float64 model (see test_trl_dpo.py): absolute tolerance
        check_orpo_exact_update(trainer, atol=1e-8)

    def test_lora(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPORPOTrainer(
            model=llama(),
            args=orpo_args(tmp_dir),
            train_dataset=preference_data(),
            processing_class=tokenizer(),
            peft_config=lora(target_modules=["q_proj", "v_proj", "down_proj"]),
        )
        assert all("lora" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
        perturb_lora_b(trainer.model)
        base = [p.detach().clone() for n, p in trainer.model.named_parameters() if "lora" not in n]
        check_orpo_exact_update(trainer, atol=1e-8)
        after = [p.detach() for n, p in trainer.model.named_parameters() if "lora" not in n]
        assert all(torch.equal(a, b) for a, b in zip(after, base, strict=True))


def test_per_pair_loss_equals_trl_loss_of_the_pair_alone(float64, tmp_dir):
    """hf_dp's per-pair ORPO loss is TRL's ORPO loss of a batch holding that pair alone (TRL computes the odds ratio in
    float32: compared at that precision)."""
    torch.manual_seed(0)
    trainer = DPORPOTrainer(
        model=gpt2(), args=orpo_args(tmp_dir), train_dataset=preference_data(), processing_class=tokenizer()
    )
    collator, rows = trainer.data_collator, trainer.train_dataset
    batch = collator([rows[i] for i in range(4)])
    ours = trainer.compute_per_example_loss(trainer.dp_forward(trainer.model, batch), batch)
    assert ours.shape == (4,)
    for i in range(4):
        theirs, _ = trainer.get_batch_loss_metrics(trainer.model, collator([rows[i]]), train_eval="eval")
        torch.testing.assert_close(ours[i], theirs.to(ours.dtype), rtol=2e-6, atol=2e-6)


def test_user_level_step_is_the_mean_of_clipped_user_sums(float64, tmp_dir):
    """privacy_unit='user': the user column passes through TRL's preparation; one SGD step is
    -(1/U) sum_u clip(sum_{i in u} g_i) over the pairs' own ORPO losses (float64); the card names the unit."""
    torch.manual_seed(0)
    data = preference_data().add_column("author", AUTHORS)
    args = orpo_args(tmp_dir, **USER_LEVEL)
    trainer = DPORPOTrainer(model=gpt2(), args=args, train_dataset=data, processing_class=tokenizer())
    check_user_level_update(trainer, lambda row: pair_loss(trainer.model, row, args.beta))
    assert "one user (column `author`)" in trainer.dp_model_card_section()


def store_orpo_stats(trainer, stats):
    """TRL's own path for its batch statistics: ``store_metrics``, averaged into the next ``log``."""
    trainer.store_metrics({key: 1.0 for key in stats}, train_eval="train")
    trainer.log({"loss": 0.5})


class TestORPORuns:
    def test_model_as_a_path_with_noise_and_eval(self, tmp_dir):
        """`model` as a path (``model_init_kwargs`` used to load it, and left as given), noise on, TRL's evaluation;
        no statistic of the training pairs is logged or written; the card's unit is the pair."""
        path = os.path.join(tmp_dir, "tiny")
        gpt2().save_pretrained(path)
        tokenizer().save_pretrained(path)
        out = os.path.join(tmp_dir, "out")
        init_kwargs = {"dtype": "float32"}
        args = orpo_args(
            out,
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            learning_rate=1e-2,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=1,
            model_init_kwargs=init_kwargs,
        )
        trainer = DPORPOTrainer(model=path, args=args, train_dataset=preference_data(), eval_dataset=preference_data())
        assert args.model_init_kwargs is init_kwargs and init_kwargs == {"dtype": "float32"}
        assert args.remove_unused_columns is False
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        assert trainer.dp_callback.steps == 2
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
        assert evals and "eval_rewards/margins" in evals[0]
        check_stats_not_written(trainer, ORPO_STATS, out, inject=store_orpo_stats)
        trainer.save_model()
        readme = open(os.path.join(out, "README.md")).read()
        assert "## Differential privacy" in readme and "one preference pair" in readme

    def test_the_mixin_alone_fails_on_the_first_forward(self, tmp_dir):
        """Why ORPO needs its own forward: composed by the recipe alone, the model is called on TRL's paired batch as
        it is (``model(**batch)``: no ``input_ids``), and the engine's layout probe, the first forward, fails."""
        from dataclasses import dataclass

        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        from hf_dp import DPArgumentsMixin, DPTrainerMixin, UnsupportedModuleError

        @dataclass
        class RecipeConfig(DPArgumentsMixin, ORPOConfig):
            pass

        class RecipeTrainer(DPTrainerMixin, ORPOTrainer):
            _dp_arguments_class = RecipeConfig

        args = RecipeConfig(**{**orpo_args(tmp_dir).to_dict(), "dp_loss_type": "causal_lm"})
        trainer = RecipeTrainer(model=gpt2(), args=args, train_dataset=preference_data(), processing_class=tokenizer())
        with pytest.raises(UnsupportedModuleError, match="input_ids"):
            trainer.train()


class TestORPORefusals:
    def test_other_dp_loss_types_are_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="causal_lm"):
            orpo_args(tmp_dir, dp_loss_type="masked_lm")

    def test_encoder_decoder_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="encoder-decoder"):
            orpo_args(tmp_dir, is_encoder_decoder=True)

    def test_plain_orpo_config_is_refused(self, tmp_dir):
        from trl.experimental.orpo import ORPOConfig

        with pytest.raises(ValueError, match="DPORPOConfig"):
            DPORPOTrainer(
                model=gpt2(),
                args=ORPOConfig(output_dir=tmp_dir, use_cpu=True, report_to="none"),
                train_dataset=preference_data(),
                processing_class=tokenizer(),
            )

    def test_pairs_with_no_completion_token_are_refused_before_training(self, tmp_dir):
        """Truncation to `max_length` that leaves every completion empty: no average log-probability (TRL's loss is
        NaN), nothing to learn: refused before the first step."""
        trainer = DPORPOTrainer(
            model=gpt2(),
            args=orpo_args(tmp_dir, max_length=1),
            train_dataset=preference_data(),
            processing_class=tokenizer(),
        )
        assert all(label == -100 for row in trainer.train_dataset for label in row["chosen_labels"])
        with pytest.raises(ValueError, match="target to learn"):
            trainer.train()
        assert trainer.dp_callback.steps == 0

    def test_moe_auxiliary_loss_is_refused(self, tmp_dir):
        """TRL's ORPO adds the router's load-balancing loss (a batch statistic) when the model's config turns the
        router logits on."""
        model = gpt2()
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.01
        with pytest.raises(ValueError, match="output_router_logits=False"):
            DPORPOTrainer(model=model, args=orpo_args(tmp_dir), train_dataset=preference_data())


def test_lazy_exports():
    import subprocess
    import sys

    code = (
        "import sys, hf_dp, hf_dp.trl; assert 'trl.experimental.orpo' not in sys.modules; "
        "from hf_dp import DPORPOConfig, DPORPOTrainer; assert 'trl.experimental.orpo' in sys.modules; "
        "import hf_dp.trainers.orpo_trainer as m; assert m.DPORPOTrainer is DPORPOTrainer is hf_dp.trl.DPORPOTrainer"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
