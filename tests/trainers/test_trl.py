"""DPSFTTrainer / DPSFTConfig (TRL) on tiny models from configs, with an offline word-level tokenizer (CPU, no Hub).

Exactness as in ``tests/trainers/test_trainer.py::check_exact_update``: sigma = 0, q = 1, SGD lr = 1, one step: the
update is exactly ``-(1/N) sum_i clip(g_i)``, with ``g_i`` the float64 autograd gradient of example ``i``'s own loss (a
batch of one, no padding) over the tokens TRL's preparation kept in its labels, and C the median norm (some examples
clipped, some not). The oracle reads the rows TRL prepared (``trainer.train_dataset``), so each test also asserts that
TRL's masks are really in them (completion-only, assistant-only).
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from helpers.oracle import clipped_unit_mean  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_dp import DPSeq2SeqTrainingArguments, DPTrainingArguments  # noqa: E402
from hf_dp.trl import DPSFTConfig, DPSFTTrainer  # noqa: E402

WORDS = ["<pad>", "<unk>", "<eos>", "user", "assistant", ":", *"abcdefghijklmnopqrstuvwxyz"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eos>{% endgeneration %}"
    "{% else %}{{ m['content'] }} <eos>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
# Word counts 4+6+3+7+5+5+6+4 = 40, plus one <eos> each: 48 tokens, so wrapped packing at 6 gives 8 full rows.
TEXTS = ["a b c d", "e f g h i j", "k l m", "n o p q r s t", "u v w x y", "z a b c d", "e f g h i j", "k l m n"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def gpt2():
    cfg = GPT2Config(
        vocab_size=len(WORDS),
        n_positions=64,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=2,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(cfg)


def llama():
    cfg = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg)


def lora(**kw):
    from peft import LoraConfig

    return LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, **kw)


def text_data():
    return Dataset.from_dict({"text": TEXTS})


def prompt_completion_data():
    prompts = ["a b ", "c d e ", "f ", "g h i j ", "k l ", "m n o ", "p ", "q r s "]  # 19 words
    completions = ["c d e", "f g", "h i j k", "l", "m n o p", "q", "r s t u v", "t u"]
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def conversation_data():
    rows = []
    for i in range(8):
        q, a = TEXTS[i], TEXTS[(i + 3) % 8]
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if i % 3 == 0:  # some multi-turn conversations
            turns += [{"role": "user", "content": "x y"}, {"role": "assistant", "content": TEXTS[(i + 5) % 8]}]
        rows.append(turns)
    return Dataset.from_dict({"messages": rows})


def conversational_prompt_completion_data():
    prompts = [[{"role": "user", "content": TEXTS[i]}] for i in range(8)]
    completions = [[{"role": "assistant", "content": TEXTS[(i + 2) % 8]}] for i in range(8)]
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def sft_args(tmp_dir, config_class=DPSFTConfig, **overrides):
    """One plain SGD step (lr 1, no noise), q = 1 for 8 rows (4 per micro-batch, 2 micro-batches), float64-friendly
    (no bf16 autocast: TRL turns bf16 on by default). TRL's other defaults (gradient checkpointing on) stay. Any DP
    TRL config (``config_class``) takes the same."""
    base = dict(
        output_dir=tmp_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,
        noise_multiplier=0.0,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        noise_seed=0,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        dataloader_pin_memory=False,
        disable_tqdm=True,
        max_length=32,
    )
    base.update(overrides)
    return config_class(**base)


def row_loss(model, row, dft=False):
    """The loss of one prepared row alone (a batch of one, no padding): next-token cross-entropy over the tokens whose
    label is not -100, mean over them (DFT: each token's NLL times its detached probability)."""
    ids = torch.tensor(row["input_ids"])[None]
    labels = torch.tensor(row["labels"])[None, 1:]
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    if dft:
        nll = nll * torch.exp(-nll).detach()
    return nll.sum() / (labels != -100).sum()


def perturb_lora_b(model):
    """LoRA B starts at zero (so A has no gradient): move it, so that every factor is exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)


def check_sft_exact_update(trainer, dft=False):
    """The trainer's one SGD step equals ``-(1/N) sum_i clip(g_i)`` (float64 per-row oracle, C = median norm)."""
    model, rows = trainer.model, trainer.train_dataset
    n = len(rows)
    assert trainer.sample_rate == 1.0, (n, trainer.sample_rate)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float64 for p in params)
    grads = []
    for i in range(n):
        g = torch.autograd.grad(row_loss(model, rows[i], dft=dft), params, allow_unused=True)
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
        torch.testing.assert_close(p.detach() - b, -e, rtol=1e-6, atol=1e-10)
    return trainer


def masked_share(rows):
    """Fraction of the prepared rows' tokens whose label is -100 (not trained on)."""
    labels = [label for row in rows for label in row["labels"]]
    return sum(label == -100 for label in labels) / len(labels)


class TestExactSFT:
    def test_text_full_model_with_gradient_checkpointing(self, float64, tmp_dir):
        torch.manual_seed(0)
        args = sft_args(tmp_dir)
        assert args.gradient_checkpointing  # TRL's default
        trainer = DPSFTTrainer(model=gpt2(), args=args, train_dataset=text_data(), processing_class=tokenizer())
        assert trainer.loss_type == "causal_lm" and masked_share(trainer.train_dataset) == 0
        check_sft_exact_update(trainer)

    def test_prompt_completion_trains_on_the_completion_only(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPSFTTrainer(
            model=llama(), args=sft_args(tmp_dir), train_dataset=prompt_completion_data(), processing_class=tokenizer()
        )
        masked = sum(label == -100 for row in trainer.train_dataset for label in row["labels"])
        assert masked == 19  # exactly the prompt tokens are masked in the labels
        check_sft_exact_update(trainer)

    def test_conversational_assistant_only_loss_with_lora(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPSFTTrainer(
            model=llama(),
            args=sft_args(tmp_dir, assistant_only_loss=True),
            train_dataset=conversation_data(),
            processing_class=tokenizer(),
            peft_config=lora(target_modules=["q_proj", "v_proj", "down_proj"]),
        )
        rows = trainer.train_dataset
        tok = tokenizer()
        for row in rows:  # only the assistant turns are trained on: no "user" token has a label
            assert all(label == -100 for i, label in zip(row["input_ids"], row["labels"], strict=True) if i == 3)
            assert any(label != -100 for label in row["labels"])
        assert tok.convert_ids_to_tokens(rows[0]["input_ids"][:3]) == ["user", ":", "a"]
        perturb_lora_b(trainer.model)
        check_sft_exact_update(trainer)

    def test_conversational_prompt_completion(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPSFTTrainer(
            model=gpt2(),
            args=sft_args(tmp_dir),
            train_dataset=conversational_prompt_completion_data(),
            processing_class=tokenizer(),
        )
        assert masked_share(trainer.train_dataset) > 0.3
        check_sft_exact_update(trainer)

    def test_wrapped_packing_each_packed_row_is_one_example(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPSFTTrainer(
            model=gpt2(),
            args=sft_args(tmp_dir, packing=True, packing_strategy="wrapped", max_length=6),
            train_dataset=text_data(),
            processing_class=tokenizer(),
        )
        rows = trainer.train_dataset
        assert len(rows) == 8 and all(len(r["input_ids"]) == 6 for r in rows)  # 48 tokens cut into 8 rows
        assert trainer.num_train_examples == 8
        check_sft_exact_update(trainer)
        card = trainer.dp_model_card_section()
        assert "one packed row of `max_length` tokens" in card and "one training example" not in card

    @pytest.mark.parametrize("reentrant", [None, True, False])
    def test_peft_config_with_gradient_checkpointing_text(self, float64, tmp_dir, reentrant):
        """`--use_peft` as TRL's sft.py runs it: LoRA through `peft_config`, gradient checkpointing on (TRL's default,
        with `enable_input_require_grads`; reentrant or not), the self-check on."""
        torch.manual_seed(0)
        kwargs = None if reentrant is None else {"use_reentrant": reentrant}
        args = sft_args(tmp_dir, gradient_checkpointing_kwargs=kwargs)
        assert args.gradient_checkpointing and args.dp_self_check
        trainer = DPSFTTrainer(
            model=gpt2(),
            args=args,
            train_dataset=text_data(),
            processing_class=tokenizer(),
            peft_config=lora(target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
        )
        assert trainer.model.peft_config and all(
            "lora" in n for n, p in trainer.model.named_parameters() if p.requires_grad
        )
        perturb_lora_b(trainer.model)
        check_sft_exact_update(trainer)
        assert trainer.model.get_base_model().transformer.gradient_checkpointing  # it did run checkpointed

    def test_formatting_func(self, float64, tmp_dir):
        torch.manual_seed(0)
        data = Dataset.from_dict({"q": TEXTS, "a": TEXTS[::-1]})
        trainer = DPSFTTrainer(
            model=gpt2(),
            args=sft_args(tmp_dir),
            train_dataset=data,
            processing_class=tokenizer(),
            formatting_func=lambda ex: f"{ex['q']} : {ex['a']}",
        )
        assert trainer.train_dataset[0]["text"] == "a b c d : k l m n<eos>"
        check_sft_exact_update(trainer)

    def test_dft_loss_per_example(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = DPSFTTrainer(
            model=gpt2(),
            args=sft_args(tmp_dir, loss_type="dft"),
            train_dataset=text_data(),
            processing_class=tokenizer(),
        )
        check_sft_exact_update(trainer, dft=True)


class TestSFTRuns:
    def test_model_as_a_path_with_noise_and_eval(self, tmp_dir):
        """`model` as a string (loaded as SFTTrainer would, with `model_init_kwargs`), noise on, TRL's evaluation."""
        path = os.path.join(tmp_dir, "tiny")
        gpt2().save_pretrained(path)
        tokenizer().save_pretrained(path)
        args = sft_args(
            os.path.join(tmp_dir, "out"),
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            learning_rate=1e-2,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=1,
            model_init_kwargs={"dtype": "float32"},
        )
        trainer = DPSFTTrainer(model=path, args=args, train_dataset=text_data(), eval_dataset=text_data())
        assert isinstance(trainer.model, GPT2LMHeadModel) and trainer.model.dtype == torch.float32
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        assert trainer.dp_callback.steps == 2
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
        assert evals and "eval_mean_token_accuracy" in evals[0]
        train_logs = [h for h in trainer.state.log_history if "loss" in h]
        assert train_logs and all("epsilon" in h for h in train_logs)
        # TRL's training-batch statistics are not computed in DP steps (they would be un-noised)
        assert not any("mean_token_accuracy" in h or "num_tokens" in h for h in train_logs)
        trainer.save_model()
        readme = open(os.path.join(tmp_dir, "out", "README.md")).read()
        assert "## Differential privacy" in readme and "one training example" in readme


AUTHORS = ["u0", "u1", "u0", "u2", "u1", "u3", "u0", "u2"]  # 4 users of 3, 2, 2 and 1 rows


def with_authors(dataset):
    return dataset.add_column("author", AUTHORS)


USER_LEVEL = {
    "privacy_unit": "user",
    "user_column": "author",
    "max_examples_per_user": 3,
    "per_device_train_batch_size": 2,  # 2 x 2 micro-batches = the 4 users: q = 1
    "gradient_accumulation_steps": 2,
}


def check_user_level_update(trainer, loss):
    """The trainer's one SGD step (sigma 0, q 1 over the users of :data:`AUTHORS`) equals
    ``-(1/U) sum_u clip(sum_{i in u} g_i)``, ``g_i`` the float64 autograd gradient of ``loss(row_i)`` on the rows TRL
    prepared (C: the median user norm, so that some users are clipped and some not)."""
    rows = trainer.train_dataset
    assert rows["author"] == AUTHORS and trainer.sample_rate == 1.0 and trainer.num_train_examples == len(set(AUTHORS))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = []
    for i in range(len(rows)):
        g = torch.autograd.grad(loss(rows[i]), params, allow_unused=True)
        grads.append([torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params, strict=True)])
    expected, clip, _ = clipped_unit_mean(grads, AUTHORS)
    trainer.args.per_sample_max_grad_norm = clip  # resolved into the plan when train() starts
    before = [p.detach().clone() for p in params]
    trainer.train()
    assert trainer.dp_callback.steps == 1
    for b, p, e in zip(before, params, expected, strict=True):
        torch.testing.assert_close(p.detach() - b, -e, rtol=1e-6, atol=1e-10)


class TestUserLevelSFT:
    @pytest.mark.parametrize("data", [text_data, prompt_completion_data, conversation_data])
    def test_one_step_is_the_mean_of_clipped_user_sums(self, float64, tmp_dir, data):
        """privacy_unit='user' through DPSFTTrainer: the user column passes through TRL's preparation, and one SGD
        step (sigma 0, q 1 over 4 users, 2 micro-batches) is -(1/U) sum_u clip(sum_{i in u} g_i) against per-row
        float64 autograd on the rows TRL prepared (C: the median user norm)."""
        torch.manual_seed(0)
        args = sft_args(tmp_dir, **USER_LEVEL)
        trainer = DPSFTTrainer(
            model=gpt2(), args=args, train_dataset=with_authors(data()), processing_class=tokenizer()
        )
        check_user_level_update(trainer, lambda row: row_loss(trainer.model, row))

    def test_packing_is_refused(self, tmp_dir):
        """Packed rows mix users (and TRL drops the user column): refused with what to set, before any data work."""
        with pytest.raises(ValueError, match="packing=False"):
            sft_args(tmp_dir, **USER_LEVEL, packing=True, packing_strategy="wrapped")


class TestRefusals:
    def test_bfd_split_packing_is_refused_with_what_to_set(self, tmp_dir):
        """A document's pieces would be clipped as separate examples (TRL's default 'bfd' and padding-free training
        are supported: each sequence clipped on its own, tests/trainers/test_trl_packing.py)."""
        with pytest.raises(ValueError, match="packing_strategy='bfd'.*packing_strategy='wrapped'"):
            sft_args(tmp_dir, packing=True, packing_strategy="bfd_split")

    def test_settings_changed_after_the_config_are_refused_at_init(self, tmp_dir):
        args = sft_args(tmp_dir, packing=True)
        args.packing_strategy = "bfd_split"
        with pytest.raises(ValueError, match="bfd_split"):
            DPSFTTrainer(model=gpt2(), args=args, train_dataset=text_data(), processing_class=tokenizer())

    @pytest.mark.parametrize("name", ["causal_lm", "auto"])
    def test_hf_dp_loss_names_in_trl_loss_type_point_to_dp_loss_type(self, tmp_dir, name):
        with pytest.raises(ValueError, match="dp_loss_type"):
            sft_args(tmp_dir, loss_type=name)

    def test_other_dp_loss_types_are_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="causal_lm"):
            sft_args(tmp_dir, dp_loss_type="masked_lm")

    def test_unknown_trl_loss_type_is_refused(self, tmp_dir):
        args = sft_args(tmp_dir)
        args.loss_type = "some_coupled_loss"
        with pytest.raises(ValueError, match="not supported by DPSFTTrainer"):
            DPSFTTrainer(model=gpt2(), args=args, train_dataset=text_data(), processing_class=tokenizer())

    def test_plain_sft_config_is_refused(self, tmp_dir):
        from trl import SFTConfig

        with pytest.raises(ValueError, match="DPSFTConfig"):
            DPSFTTrainer(
                model=gpt2(),
                args=SFTConfig(output_dir=tmp_dir, use_cpu=True, report_to="none"),
                train_dataset=text_data(),
                processing_class=tokenizer(),
            )

    def test_moe_load_balancing_loss_is_refused(self, tmp_dir):
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(
            vocab_size=len(WORDS),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=2,
            num_experts_per_tok=1,
        )
        data, tok = text_data(), tokenizer()
        with pytest.raises(ValueError, match="router_aux_loss_coef=0.0"):
            DPSFTTrainer(
                model=MixtralForCausalLM(cfg), args=sft_args(tmp_dir), train_dataset=data, processing_class=tok
            )

    def test_activation_offloading_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="activation_offloading=False"):
            sft_args(tmp_dir, activation_offloading=True)

    def test_dft_with_label_smoothing_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="label_smoothing_factor=0"):
            sft_args(tmp_dir, loss_type="dft", label_smoothing_factor=0.1)


class TestLossTypeRename:
    def test_sft_config_keeps_trl_loss_type(self, tmp_dir):
        args = sft_args(tmp_dir, loss_type="dft")
        assert args.loss_type == "dft" and args.dp_loss_type == "causal_lm"

    @pytest.mark.parametrize("cls", [DPTrainingArguments, DPSeq2SeqTrainingArguments])
    def test_deprecated_loss_type_still_sets_dp_loss_type(self, tmp_dir, cls):
        with pytest.warns(FutureWarning, match="dp_loss_type"):
            args = cls(output_dir=tmp_dir, noise_multiplier=1.0, loss_type="masked_lm", use_cpu=True)
        assert args.dp_loss_type == "masked_lm"

    def test_dp_loss_type_alone_does_not_warn(self, tmp_dir):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            args = DPTrainingArguments(output_dir=tmp_dir, noise_multiplier=1.0, dp_loss_type="masked_lm", use_cpu=True)
        assert args.dp_loss_type == "masked_lm" and args.loss_type is None

    def test_conflicting_names_are_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="Set `dp_loss_type` only"), pytest.warns(FutureWarning):
            DPTrainingArguments(
                output_dir=tmp_dir, noise_multiplier=1.0, loss_type="masked_lm", dp_loss_type="causal_lm"
            )

    def test_unknown_dp_loss_type(self, tmp_dir):
        with pytest.raises(ValueError, match="Unknown `dp_loss_type`"):
            DPTrainingArguments(output_dir=tmp_dir, noise_multiplier=1.0, dp_loss_type="nll")


def test_import_hf_dp_without_trl():
    """`import hf_dp` never imports TRL; without TRL, `hf_dp.DPSFTTrainer` says what to install."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["trl"] = None  # TRL not installed
        import hf_dp
        assert "trl" not in sys.modules or sys.modules["trl"] is None
        try:
            hf_dp.DPSFTTrainer
        except ImportError as error:
            assert "pip install 'hf_dp[trl]'" in str(error), error
        else:
            raise AssertionError("no ImportError")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_import_hf_dp_does_not_import_trl():
    code = (
        "import sys, hf_dp; assert 'trl' not in sys.modules; "
        "from hf_dp import DPSFTTrainer; assert 'trl' in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
