"""DPDPOTrainer / DPDPOConfig (TRL DPO) on tiny models from configs, with the offline word-level tokenizer of
``tests/trainers/test_trl.py`` (CPU, no Hub).

Exactness as in ``test_trl.py::check_sft_exact_update``: sigma = 0, q = 1, SGD lr = 1, one step: the update is exactly
``-(1/N) sum_i clip(g_i)``, with ``g_i`` the float64 autograd gradient of pair ``i``'s own DPO loss, computed here from
the pair alone (batch of one, no padding): the policy's and the frozen reference's summed log-probabilities of the
chosen and rejected completion tokens of the rows TRL prepared (``trainer.train_dataset``), and C the median norm.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from test_trl import gpt2, llama, lora, perturb_lora_b, sft_args, tokenizer  # noqa: E402

from hf_dp.trl import DPDPOConfig, DPDPOTrainer  # noqa: E402

PROMPTS = ["a b ", "c d e ", "f ", "g h i j ", "k l ", "m n o ", "p ", "q r s "]
CHOSEN = ["c d e ", "f g ", "h i j k ", "l ", "m n o p ", "q ", "r s t u v ", "t u "]
REJECTED = ["x y ", "z ", "a b c ", "w v u t ", "s ", "r q p ", "o n ", "m l k j "]


def preference_data():
    return Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})


def conversational_preference_data():
    def turn(role, text):
        return [{"role": role, "content": text.strip()}]

    return Dataset.from_dict(
        {
            "prompt": [turn("user", p) for p in PROMPTS],
            "chosen": [turn("assistant", c) for c in CHOSEN],
            "rejected": [turn("assistant", r) for r in REJECTED],
        }
    )


def dpo_args(tmp_dir, **overrides):
    """``sft_args``' single SGD step for 8 pairs, with beta large enough that the loss is far from linear."""
    return sft_args(tmp_dir, DPDPOConfig, **{"beta": 0.5, **overrides})


def completion_log_prob(model, prompt_ids, completion_ids):
    """Summed log-probability of ``completion_ids`` after ``prompt_ids`` (one sequence, no padding)."""
    ids = torch.tensor(prompt_ids + completion_ids)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt_ids) - 1 :].sum()


def pair_loss(policy, reference, row, beta, loss_type="sigmoid"):
    """Pair ``row``'s own DPO loss (TRL's formulas), the reference's log-probabilities under no_grad."""
    p, c, r = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
    with torch.no_grad():
        ref_c, ref_r = reference(p, c), reference(p, r)
    chosen = completion_log_prob(policy, p, c) - ref_c
    rejected = completion_log_prob(policy, p, r) - ref_r
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (chosen - rejected))
    if loss_type == "ipo":  # per-token log-ratios, over the completion lengths
        return ((chosen / len(c) - rejected / len(r)) - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * (chosen - rejected))
    raise ValueError(loss_type)


def model_reference(ref_model):
    return lambda p, c: completion_log_prob(ref_model, p, c)


def adapter_disabled_reference(peft_model):
    def reference(p, c):
        with peft_model.disable_adapter():
            return completion_log_prob(peft_model, p, c)

    return reference


def check_dpo_exact_update(trainer, reference, loss=None, atol=1e-10):
    """The trainer's one SGD step equals ``-(1/N) sum_i clip(g_i)`` (float64 per-pair oracle, C = median norm)."""
    model, rows = trainer.model, trainer.train_dataset
    n = len(rows)
    assert trainer.sample_rate == 1.0, (n, trainer.sample_rate)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float64 for p in params)
    loss = loss or (lambda row: pair_loss(model, reference, row, trainer.args.beta))
    grads = []
    for i in range(n):
        g = torch.autograd.grad(loss(rows[i]), params, allow_unused=True)
        grads.append([torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params, strict=True)])
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip).any()
    coef = (clip / (norms + 1e-6)).clamp(max=1.0)
    expected = [sum(coef[i] * grads[i][k] for i in range(n)) / n for k in range(len(params))]
    trainer.args.per_sample_max_grad_norm = clip  # resolved into the plan when train() starts
    before = [p.detach().clone() for p in params]
    trainer.train()
    assert trainer.dp_callback.steps == 1
    assert trainer.dp_plan.max_grad_norm == clip
    for b, p, e in zip(before, params, expected, strict=True):
        torch.testing.assert_close(p.detach() - b, -e, rtol=1e-6, atol=atol)
    return trainer


def check_reference_untouched(ref_model, before):
    for (name, p), b in zip(ref_model.named_parameters(), before, strict=True):
        assert p.grad is None, name
        assert torch.equal(p.detach(), b), name


class TestExactDPO:
    def test_standard_full_model_with_gradient_checkpointing(self, float64, tmp_dir):
        torch.manual_seed(0)
        args = dpo_args(tmp_dir)
        assert args.gradient_checkpointing and args.dp_self_check  # TRL's default, hf_dp's default
        policy = gpt2()
        reference = _frozen(policy)
        trainer = DPDPOTrainer(model=policy, args=args, train_dataset=preference_data(), processing_class=tokenizer())
        ref_model = trainer.ref_model
        assert ref_model is not None and ref_model is not trainer.model
        assert all(not p.requires_grad for p in ref_model.parameters())
        before = [p.detach().clone() for p in ref_model.parameters()]
        row = trainer.train_dataset[0]
        assert tokenizer().convert_ids_to_tokens(row["chosen_ids"]) == ["c", "d", "e", "<eos>"]
        check_dpo_exact_update(trainer, model_reference(reference))
        check_reference_untouched(ref_model, before)
        assert trainer.model.transformer.gradient_checkpointing  # it did run checkpointed

    def test_conversational_llama_with_explicit_ref_model(self, float64, tmp_dir):
        torch.manual_seed(0)
        policy, ref_model = llama(), llama()  # a reference that is not the initial policy
        trainer = DPDPOTrainer(
            model=policy,
            ref_model=ref_model,
            args=dpo_args(tmp_dir),
            train_dataset=conversational_preference_data(),
            processing_class=tokenizer(),
        )
        assert trainer.ref_model is ref_model
        row = trainer.train_dataset[0]
        assert tokenizer().convert_ids_to_tokens(row["prompt_ids"])[-2:] == ["assistant", ":"]
        before = [p.detach().clone() for p in ref_model.parameters()]
        # Llama's RMSNorm normalises in float32 even in a float64 model, while the engine's RMSNorm rule normalises in
        # float64: the norm weights' per-pair gradients differ from autograd's by ~1e-7 of their size (also with a
        # single forward pass), hence the absolute tolerance.
        check_dpo_exact_update(trainer, model_reference(_frozen(ref_model)), atol=1e-8)
        check_reference_untouched(ref_model, before)

    @pytest.mark.parametrize("reentrant", [None, False])
    def test_peft_reference_is_the_adapter_disabled_policy(self, float64, tmp_dir, reentrant):
        torch.manual_seed(0)
        kwargs = None if reentrant is None else {"use_reentrant": reentrant}
        trainer = DPDPOTrainer(
            model=gpt2(),
            args=dpo_args(tmp_dir, gradient_checkpointing_kwargs=kwargs),
            train_dataset=preference_data(),
            processing_class=tokenizer(),
            peft_config=lora(target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
        )
        assert trainer.ref_model is None  # TRL's PEFT path: the base model, adapter disabled
        assert all("lora" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
        perturb_lora_b(trainer.model)
        base = [p.detach().clone() for n, p in trainer.model.named_parameters() if "lora" not in n]
        check_dpo_exact_update(trainer, adapter_disabled_reference(trainer.model))
        after = [p.detach() for n, p in trainer.model.named_parameters() if "lora" not in n]
        assert all(torch.equal(a, b) for a, b in zip(after, base, strict=True))  # the reference did not move

    def test_precomputed_reference_log_probs(self, float64, tmp_dir):
        """TRL computes the reference log-probabilities of every pair at init (its fused LM head, in float32): the loss
        of pair i reads pair i's stored values."""
        torch.manual_seed(0)
        policy = gpt2()
        reference = _frozen(policy)
        trainer = DPDPOTrainer(
            model=policy,
            args=dpo_args(tmp_dir, precompute_ref_log_probs=True),
            train_dataset=preference_data(),
            processing_class=tokenizer(),
        )
        assert trainer.ref_model is None and "ref_chosen_logps" in trainer.train_dataset.column_names
        row = trainer.train_dataset[1]
        expected = completion_log_prob(reference, row["prompt_ids"], row["chosen_ids"])
        torch.testing.assert_close(torch.tensor(row["ref_chosen_logps"]), expected.detach(), rtol=1e-5, atol=1e-5)

        def loss(row):
            p, c, r = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
            chosen = completion_log_prob(trainer.model, p, c) - row["ref_chosen_logps"]
            rejected = completion_log_prob(trainer.model, p, r) - row["ref_rejected_logps"]
            return -F.logsigmoid(trainer.args.beta * (chosen - rejected))

        check_dpo_exact_update(trainer, None, loss=loss)

    @pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
    def test_other_per_pair_losses(self, float64, tmp_dir, loss_type):
        torch.manual_seed(0)
        policy = gpt2()
        reference = model_reference(_frozen(policy))
        trainer = DPDPOTrainer(
            model=policy,
            args=dpo_args(tmp_dir, loss_type=loss_type, beta=2.0 if loss_type == "hinge" else 0.5),
            train_dataset=preference_data(),
            processing_class=tokenizer(),
        )

        def loss(row):
            return pair_loss(trainer.model, reference, row, trainer.args.beta, loss_type)

        check_dpo_exact_update(trainer, reference, loss=loss)

    def test_weighted_sum_of_losses(self, float64, tmp_dir):
        torch.manual_seed(0)
        policy = gpt2()
        reference = model_reference(_frozen(policy))
        trainer = DPDPOTrainer(
            model=policy,
            args=dpo_args(tmp_dir, loss_type=["sigmoid", "ipo"], loss_weights=[0.7, 0.3]),
            train_dataset=preference_data(),
            processing_class=tokenizer(),
        )

        def loss(row):
            model, beta = trainer.model, trainer.args.beta
            return 0.7 * pair_loss(model, reference, row, beta) + 0.3 * pair_loss(model, reference, row, beta, "ipo")

        check_dpo_exact_update(trainer, reference, loss=loss)


def _frozen(model):
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


# Every supported loss type: hf_dp's per-pair loss equals TRL's own DPO loss of a batch holding that pair alone.
PER_PAIR_SETTINGS = [
    {"loss_type": name}
    for name in [
        "sigmoid",
        "hinge",
        "ipo",
        "nca_pair",
        "bco_pair",
        "sppo_hard",
        "apo_zero",
        "apo_down",
        "discopop",
        "sigmoid_norm",
        "sft",
    ]
] + [
    {"loss_type": "robust", "label_smoothing": 0.2},
    {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    {"loss_type": "sigmoid", "f_divergence_type": "forward_kl"},
    {"loss_type": "sigmoid", "f_divergence_type": "js_divergence"},
    {"loss_type": "sigmoid", "ld_alpha": 0.5},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
]


@pytest.mark.parametrize("settings", PER_PAIR_SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_per_pair_loss_equals_trl_loss_of_the_pair_alone(float64, tmp_dir, settings):
    from trl import DPOTrainer

    torch.manual_seed(0)
    trainer = DPDPOTrainer(
        model=gpt2(), args=dpo_args(tmp_dir, **settings), train_dataset=preference_data(), processing_class=tokenizer()
    )
    with torch.no_grad():  # move the policy away from the reference, so that every log-ratio is non-zero
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    collator, rows = trainer.data_collator, trainer.train_dataset
    batch = collator([rows[i] for i in range(4)])
    trainer._in_train = True  # training_step's pairing, outside train()
    paired = trainer._pair_batch(batch)
    trainer._in_train = False
    assert paired["input_ids"].shape[:2] == (4, 2) and paired["ref_chosen_logps"].shape == (4,)
    ours = trainer.compute_per_example_loss(trainer.policy_log_probs(trainer.model, paired), paired)
    assert ours.shape == (4,)
    for i in range(4):
        alone = collator([rows[i]])
        theirs = DPOTrainer._compute_loss(trainer, trainer.model, alone, return_outputs=False)
        # TRL scores the tokens with its fused LM head, whose log-probabilities are float32: compare at that precision
        torch.testing.assert_close(ours[i], theirs.to(ours.dtype), rtol=2e-5, atol=2e-6)


def test_user_level_step_is_the_mean_of_clipped_user_sums(float64, tmp_dir):
    """privacy_unit='user' through DPDPOTrainer: the user column passes through TRL's preparation and the pairing of
    the batch, and one SGD step (sigma 0, q 1 over 4 users of 3, 2, 2 and 1 pairs) is -(1/U) sum_u clip(sum_{i in u}
    g_i) over the pairs' own DPO losses in float64 (C: the median user norm); the card names the unit."""
    from test_trl import AUTHORS, USER_LEVEL, check_user_level_update

    torch.manual_seed(0)
    policy = gpt2()
    reference = model_reference(_frozen(policy))
    args = dpo_args(tmp_dir, **USER_LEVEL)
    data = preference_data().add_column("author", AUTHORS)
    trainer = DPDPOTrainer(model=policy, args=args, train_dataset=data, processing_class=tokenizer())
    check_user_level_update(trainer, lambda row: pair_loss(policy, reference, row, args.beta))
    assert "one user (column `author`)" in trainer.dp_model_card_section()


class TestDPORuns:
    def test_model_as_a_path_with_noise_and_eval(self, tmp_dir):
        """`model` as a path, noise on, TRL's evaluation; no reward metric of the training pairs is logged."""
        path = os.path.join(tmp_dir, "tiny")
        gpt2().save_pretrained(path)
        tokenizer().save_pretrained(path)
        args = dpo_args(
            os.path.join(tmp_dir, "out"),
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            learning_rate=1e-2,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=1,
            model_init_kwargs={"dtype": "float32"},
        )
        trainer = DPDPOTrainer(model=path, args=args, train_dataset=preference_data(), eval_dataset=preference_data())
        ref_before = [p.detach().clone() for p in trainer.ref_model.parameters()]
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        assert trainer.dp_callback.steps == 2
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
        check_reference_untouched(trainer.ref_model, ref_before)
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
        assert evals and "eval_rewards/margins" in evals[0]
        train_logs = [h for h in trainer.state.log_history if "loss" in h]
        assert train_logs and all("epsilon" in h for h in train_logs)
        assert not any(
            k.startswith(("rewards/", "logps/", "logits/")) or k in ("entropy", "num_tokens")
            for h in train_logs
            for k in h
        )
        trainer.save_model()
        readme = open(os.path.join(tmp_dir, "out", "README.md")).read()
        assert "## Differential privacy" in readme and "one preference pair" in readme


class TestDPORefusals:
    @pytest.mark.parametrize("name", ["aot", "aot_unpaired"])
    def test_losses_that_sort_the_batch_are_refused(self, tmp_dir, name):
        with pytest.raises(ValueError, match="sorts the log-ratios"):
            dpo_args(tmp_dir, loss_type=name)

    @pytest.mark.parametrize("name", ["causal_lm", "auto"])
    def test_hf_dp_loss_names_point_to_dp_loss_type(self, tmp_dir, name):
        with pytest.raises(ValueError, match="dp_loss_type"):
            dpo_args(tmp_dir, loss_type=name)

    def test_unknown_loss_type_is_refused(self, tmp_dir):
        args = dpo_args(tmp_dir)
        args.loss_type = ["some_coupled_loss"]
        with pytest.raises(ValueError, match="not supported by DPDPOTrainer"):
            DPDPOTrainer(model=gpt2(), args=args, train_dataset=preference_data(), processing_class=tokenizer())

    def test_label_smoothing_that_would_be_ignored_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="label_smoothing=0.0"):
            dpo_args(tmp_dir, label_smoothing=0.1)

    def test_wpo_weighting_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="use_weighting=False"):
            dpo_args(tmp_dir, use_weighting=True)

    def test_activation_offloading_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="activation_offloading=False"):
            dpo_args(tmp_dir, activation_offloading=True)

    def test_other_dp_loss_types_are_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="causal_lm"):
            dpo_args(tmp_dir, dp_loss_type="masked_lm")

    def test_plain_dpo_config_is_refused(self, tmp_dir):
        from trl import DPOConfig

        with pytest.raises(ValueError, match="DPDPOConfig"):
            DPDPOTrainer(
                model=gpt2(),
                args=DPOConfig(output_dir=tmp_dir, use_cpu=True, report_to="none"),
                train_dataset=preference_data(),
                processing_class=tokenizer(),
            )


def test_lazy_exports():
    import subprocess
    import sys

    code = (
        "import sys, hf_dp; assert 'trl' not in sys.modules; "
        "from hf_dp import DPDPOConfig, DPDPOTrainer; assert 'trl' in sys.modules; "
        "import hf_dp.trainers.dpo_trainer as m; assert m.DPDPOTrainer is DPDPOTrainer"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
