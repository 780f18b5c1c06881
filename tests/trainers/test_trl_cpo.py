"""DPCPOTrainer / DPCPOConfig (TRL's CPO, SimPO and AlphaPO, ``trl.experimental.cpo``) on tiny models from configs, with
the offline word-level tokenizer of ``tests/trainers/test_trl.py`` (CPU, no Hub).

Exactness as in ``test_trl_dpo.py``: sigma = 0, q = 1, SGD lr = 1, one step: the update is exactly
``-(1/N) sum_i clip(g_i)``, with ``g_i`` the float64 autograd gradient of pair ``i``'s own CPO loss, computed here from
the pair alone (its chosen and its rejected sequence each in a batch of one, no padding) on the rows TRL prepared, with
TRL's formulas for each loss type (AlphaPO's reward as ``(1 - p ** -alpha) / alpha``), and C the median norm.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from test_trl import gpt2, llama, lora, perturb_lora_b, sft_args, tokenizer  # noqa: E402
from test_trl_dpo import check_dpo_exact_update, preference_data  # noqa: E402
from test_trl_orpo import store_orpo_stats, token_log_probs  # noqa: E402
from test_trl_reward import check_stats_not_written, implicit_prompt_data  # noqa: E402

from hf_dp.trl import DPCPOConfig, DPCPOTrainer  # noqa: E402

#: What TRL's CPOTrainer logs from the training batches (un-noised statistics of the training pairs).
CPO_STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/rejected",
    "logps/chosen",
    "logits/rejected",
    "logits/chosen",
    "nll_loss",
)


def cpo_args(tmp_dir, **overrides):
    """``sft_args``' single SGD step for 8 pairs."""
    return sft_args(tmp_dir, DPCPOConfig, **{"beta": 0.5, **overrides})


def completion_log_probs(model, row, side):
    tokens = token_log_probs(model, row[f"{side}_input_ids"])
    return tokens[torch.tensor(row[f"{side}_labels"][1:]) != -100]


def pair_loss(model, row, args):
    """Pair ``row``'s own CPO loss (TRL's formulas for a batch of that pair alone)."""
    chosen, rejected = completion_log_probs(model, row, "chosen"), completion_log_probs(model, row, "rejected")
    average = args.loss_type in ("ipo", "simpo")
    chosen_logps = chosen.mean() if average else chosen.sum()
    rejected_logps = rejected.mean() if average else rejected.sum()
    if args.alpha != 0.0:
        chosen_logps = (1 - torch.exp(chosen_logps) ** -args.alpha) / args.alpha
        rejected_logps = (1 - torch.exp(rejected_logps) ** -args.alpha) / args.alpha
    z, beta, smoothing = chosen_logps - rejected_logps, args.beta, args.label_smoothing
    if args.loss_type == "simpo":
        z = z - args.simpo_gamma / beta
    if args.loss_type in ("sigmoid", "simpo"):
        loss = -(1 - smoothing) * F.logsigmoid(beta * z) - smoothing * F.logsigmoid(-beta * z)
    elif args.loss_type == "hinge":
        loss = torch.relu(1 - beta * z)
    else:
        loss = (z - 1 / (2 * beta)) ** 2
    nll = -(chosen.mean() if args.per_example_loss_reduction == "mean" else chosen.sum())
    return loss + args.cpo_alpha * nll


def check_cpo_exact_update(trainer, atol=1e-10):
    return check_dpo_exact_update(
        trainer, None, loss=lambda row: pair_loss(trainer.model, row, trainer.args), atol=atol
    )


#: Every CPO loss type, and the options that change the per-pair loss.
PER_PAIR_SETTINGS = [
    {},  # sigmoid with the BC term: CPO
    {"loss_type": "hinge", "beta": 0.05},
    {"loss_type": "ipo"},
    {"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.3},  # SimPO
    {"loss_type": "simpo", "cpo_alpha": 0.5},  # CPO-SimPO
    {"loss_type": "alphapo", "alpha": 0.25},  # AlphaPO: simpo, cpo_alpha 0
    {"loss_type": "sigmoid", "label_smoothing": 0.2, "alpha": -0.5},
    {"per_example_loss_reduction": "sum"},
]


def _ids(settings):
    return "-".join(f"{k}={v}" for k, v in settings.items()) or "default"


class TestExactCPO:
    @pytest.mark.parametrize("settings", PER_PAIR_SETTINGS, ids=_ids)
    def test_each_loss_type_gpt2_with_gradient_checkpointing(self, float64, tmp_dir, settings):
        torch.manual_seed(0)
        args = cpo_args(tmp_dir, **settings)
        assert args.gradient_checkpointing and args.dp_self_check  # TRL's default, hf_dp's default
        if settings.get("loss_type") == "alphapo":
            assert args.loss_type == "simpo" and args.cpo_alpha == 0.0  # TRL's AlphaPO settings
        trainer = DPCPOTrainer(model=gpt2(), args=args, train_dataset=preference_data(), processing_class=tokenizer())
        check_cpo_exact_update(trainer)

    def test_implicit_prompt_llama_with_lora(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPCPOTrainer(
            model=llama(),
            args=cpo_args(tmp_dir, loss_type="simpo", cpo_alpha=0.5),
            train_dataset=implicit_prompt_data(),
            processing_class=tokenizer(),
            peft_config=lora(target_modules=["q_proj", "v_proj", "down_proj"]),
        )
        assert trainer.train_dataset[0]["prompt"].strip() == "a b"  # TRL extracted the shared prompt
        assert all("lora" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
        perturb_lora_b(trainer.model)
        base = [p.detach().clone() for n, p in trainer.model.named_parameters() if "lora" not in n]
        # Llama's RMSNorm normalises in float32 even in a float64 model (see test_trl_dpo.py): absolute tolerance
        check_cpo_exact_update(trainer, atol=1e-8)
        after = [p.detach() for n, p in trainer.model.named_parameters() if "lora" not in n]
        assert all(torch.equal(a, b) for a, b in zip(after, base, strict=True))


@pytest.mark.parametrize("settings", PER_PAIR_SETTINGS[:-1], ids=_ids)
def test_per_pair_loss_equals_trl_loss_of_the_pair_alone(float64, tmp_dir, settings):
    torch.manual_seed(0)
    trainer = DPCPOTrainer(
        model=gpt2(), args=cpo_args(tmp_dir, **settings), train_dataset=preference_data(), processing_class=tokenizer()
    )
    collator, rows = trainer.data_collator, trainer.train_dataset
    batch = collator([rows[i] for i in range(4)])
    ours = trainer.compute_per_example_loss(trainer.dp_forward(trainer.model, batch), batch)
    assert ours.shape == (4,)
    for i in range(4):
        theirs, _ = trainer.get_batch_loss_metrics(trainer.model, collator([rows[i]]), train_eval="eval")
        torch.testing.assert_close(ours[i], theirs.to(ours.dtype), rtol=1e-6, atol=1e-8)


class TestCPORuns:
    def test_model_as_a_path_with_noise_and_eval(self, tmp_dir):
        """`model` as a path, noise on, TRL's evaluation; no statistic of the training pairs is logged or written; the
        card's unit is the pair."""
        path = os.path.join(tmp_dir, "tiny")
        gpt2().save_pretrained(path)
        tokenizer().save_pretrained(path)
        out = os.path.join(tmp_dir, "out")
        args = cpo_args(
            out,
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            learning_rate=1e-2,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=1,
            model_init_kwargs={"dtype": "float32"},
        )
        trainer = DPCPOTrainer(model=path, args=args, train_dataset=preference_data(), eval_dataset=preference_data())
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        assert trainer.dp_callback.steps == 2
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
        assert evals and "eval_rewards/margins" in evals[0]
        check_stats_not_written(trainer, CPO_STATS, out, inject=store_orpo_stats)
        trainer.save_model()
        readme = open(os.path.join(out, "README.md")).read()
        assert "## Differential privacy" in readme and "one preference pair" in readme


class TestCPORefusals:
    @pytest.mark.parametrize("name", ["causal_lm", "auto"])
    def test_hf_dp_loss_names_point_to_dp_loss_type(self, tmp_dir, name):
        with pytest.raises(ValueError, match="dp_loss_type"):
            cpo_args(tmp_dir, loss_type=name)

    def test_unknown_loss_type_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="not supported by DPCPOTrainer"):
            cpo_args(tmp_dir, loss_type="kto_pair")

    @pytest.mark.parametrize("name", ["hinge", "ipo"])
    def test_label_smoothing_that_would_be_ignored_is_refused(self, tmp_dir, name):
        with pytest.raises(ValueError, match="label_smoothing=0.0"):
            cpo_args(tmp_dir, loss_type=name, label_smoothing=0.1)

    def test_other_dp_loss_types_are_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="causal_lm"):
            cpo_args(tmp_dir, dp_loss_type="masked_lm")

    def test_encoder_decoder_model_is_refused(self, tmp_dir):
        from transformers import T5Config, T5ForConditionalGeneration

        model = T5ForConditionalGeneration(T5Config(vocab_size=40, d_model=8, d_ff=8, num_layers=1, num_heads=1))
        with pytest.raises(ValueError, match="encoder-decoder"):
            DPCPOTrainer(model=model, args=cpo_args(tmp_dir), train_dataset=preference_data())


def test_lazy_exports():
    import subprocess
    import sys

    code = (
        "import sys, hf_dp, hf_dp.trl; assert 'trl.experimental.cpo' not in sys.modules; "
        "from hf_dp import DPCPOConfig, DPCPOTrainer; assert 'trl.experimental.cpo' in sys.modules; "
        "import hf_dp.trainers.cpo_trainer as m; assert m.DPCPOTrainer is DPCPOTrainer is hf_dp.trl.DPCPOTrainer"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
