"""DPSFTTrainer with TRL's default packing (``packing=True``, ``packing_strategy="bfd"``: padding-free rows) and with
``padding_free=True``: each sequence is one example, sampled, counted and clipped on its own inside the packed row.

Exactness as in ``test_trl.py``: sigma = 0, q = 1, SGD lr = 1, one step equals ``-(1/N) sum_s clip(g_s)`` with ``g_s``
the float64 autograd gradient of sequence ``s``'s own loss **run alone** (a batch of one, no padding, no packing: the
oracle knows nothing of packing), C the median norm. Each test also asserts that the model really received packed rows
(several sequences in one row, ``position_ids`` restarting, no attention mask), as TRL's padding-free collator makes
them.
"""

import pytest
import torch

pytest.importorskip("trl")

from test_trl import (  # noqa: E402
    check_sft_exact_update,
    gpt2,
    llama,
    lora,
    perturb_lora_b,
    prompt_completion_data,
    sft_args,
    text_data,
    tokenizer,
)

from hf_dp.layers import UnsupportedModuleError  # noqa: E402
from hf_dp.packed_sequences import packed_sequence_ids  # noqa: E402
from hf_dp.trl import DPSFTConfig, DPSFTTrainer  # noqa: E402

SEQUENCE_UNIT = "one sequence: one example of the training set"


def record_model_inputs(model):
    """The keyword inputs of every forward pass of ``model`` in training mode, with gradients, from the trainer (the
    oracle's own calls pass no `position_ids`)."""
    seen = []

    def hook(module, args, kwargs):
        if torch.is_grad_enabled() and module.training and "position_ids" in kwargs:
            seen.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def assert_packed(seen, sequences_per_row):
    """The model got padding-free rows: one row holding several sequences, positions restarting, no mask."""
    assert seen, "no training forward pass recorded"
    counts = []
    for inputs in seen:
        ids, position_ids = inputs["input_ids"], inputs["position_ids"]
        assert ids.shape[0] == 1 and position_ids.shape == ids.shape
        assert inputs.get("attention_mask") is None
        assert inputs.get("use_cache") is False
        assert "cu_seq_lens_q" in inputs  # TRL's own padding-free collator made the batch
        counts.append(int(packed_sequence_ids(position_ids).max()) + 1)
    assert max(counts) == sequences_per_row, counts


def build(tmp_dir, model, data, *, peft_config=None, **overrides):
    args = sft_args(tmp_dir, **overrides)
    trainer = DPSFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer(), peft_config=peft_config
    )
    return trainer


class TestExactPackedSFT:
    def test_bfd_packing_clips_each_sequence_with_gradient_checkpointing(self, float64, tmp_dir):
        torch.manual_seed(0)
        trainer = build(tmp_dir, gpt2(), text_data(), packing=True)
        assert trainer.args.packing_strategy == "bfd" and trainer.args.gradient_checkpointing  # TRL's defaults
        rows = trainer.train_dataset
        assert len(rows) == 8 and "seq_lengths" not in rows.column_names  # not packed: sampled as sequences
        assert trainer.num_train_examples == 8 and trainer.sample_rate == 1.0
        seen, handle = record_model_inputs(trainer.model)
        check_sft_exact_update(trainer)
        handle.remove()
        assert_packed(seen, sequences_per_row=4)  # 4 sequences per micro-batch, packed into one row
        assert SEQUENCE_UNIT in trainer.dp_model_card_section()

    def test_llama_lora_prompt_completion(self, float64, tmp_dir):
        """Completion-only loss (the prompt's labels -100) and LoRA, in one packed row per micro-batch."""
        torch.manual_seed(1)
        trainer = build(
            tmp_dir,
            llama(),
            prompt_completion_data(),
            packing=True,
            peft_config=lora(target_modules=["q_proj", "v_proj", "down_proj"]),
        )
        assert sum(label == -100 for row in trainer.train_dataset for label in row["labels"]) == 19
        perturb_lora_b(trainer.model)
        seen, handle = record_model_inputs(trainer.model)
        check_sft_exact_update(trainer)
        handle.remove()
        assert_packed(seen, sequences_per_row=4)

    def test_dft_loss_per_sequence(self, float64, tmp_dir):
        torch.manual_seed(2)
        trainer = build(tmp_dir, llama(), text_data(), packing=True, loss_type="dft")
        check_sft_exact_update(trainer, dft=True)

    def test_padding_free_without_packing(self, float64, tmp_dir):
        """`padding_free=True` (TRL needs `max_length=None` then): the same per-sequence clipping."""
        torch.manual_seed(3)
        trainer = build(tmp_dir, gpt2(), text_data(), padding_free=True, max_length=None)
        seen, handle = record_model_inputs(trainer.model)
        check_sft_exact_update(trainer)
        handle.remove()
        assert_packed(seen, sequences_per_row=4)
        assert SEQUENCE_UNIT in trainer.dp_model_card_section()


class TestPackedSFTRuns:
    def test_poisson_steps_count_sequences_and_the_self_check_runs(self, tmp_dir, monkeypatch):
        """q is per sequence (L / N with N the sequences), several noisy steps run with TRL's evaluation (on bfd-packed
        rows, as TRL evaluates), and the per-sequence self-check (each sequence against itself alone) runs on the
        first micro-batch of two sequences or more, even with `dp_self_check=False`."""
        from hf_dp.engine import clipper as clipper_module

        checked = []
        real = clipper_module.packed_self_check

        def spy(clipper, inputs, loss_fn, **kwargs):
            checked.append(int(packed_sequence_ids(inputs["position_ids"]).max()) + 1)
            return real(clipper, inputs, loss_fn, **kwargs)

        monkeypatch.setattr(clipper_module, "packed_self_check", spy)
        torch.manual_seed(4)
        args = sft_args(
            tmp_dir,
            packing=True,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            learning_rate=1e-2,
            max_steps=3,
            dp_self_check=False,
            eval_strategy="steps",
            eval_steps=3,
        )
        trainer = DPSFTTrainer(
            model=llama(), args=args, train_dataset=text_data(), eval_dataset=text_data(), processing_class=tokenizer()
        )
        assert trainer.sample_rate == 4 / 8 and trainer.num_train_examples == 8
        assert "seq_lengths" in trainer.eval_dataset.column_names  # TRL's own bfd packing for evaluation
        trainer.train()
        assert trainer.dp_callback.steps == 3
        assert len(checked) == 1 and checked[0] >= 2
        assert any("eval_loss" in h for h in trainer.state.log_history)

    def test_attention_that_crosses_sequences_is_refused_before_any_update(self, tmp_dir):
        """Called with a cache (`use_cache=True`), transformers builds no block-causal mask: the sequences of the
        packed row attend to each other, and the first micro-batch is refused before the optimizer steps."""

        class CachingTrainer(DPSFTTrainer):
            def _model_inputs(self, model, inputs):
                return {**super()._model_inputs(model, inputs), "use_cache": True}

        torch.manual_seed(5)
        args = sft_args(tmp_dir, packing=True, dp_self_check=False)
        trainer = CachingTrainer(model=gpt2(), args=args, train_dataset=text_data(), processing_class=tokenizer())
        before = [p.detach().clone() for p in trainer.model.parameters()]
        with pytest.raises(UnsupportedModuleError, match="attend to each other"):
            trainer.train()
        assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
        assert trainer.dp_callback.steps == 0


class TestPackingRefusals:
    def test_bfd_split_is_refused_with_what_to_set(self, tmp_dir):
        with pytest.raises(ValueError, match="bfd_split.*Set `packing_strategy='bfd'`"):
            sft_args(tmp_dir, packing=True, packing_strategy="bfd_split")

    def test_padding_to_a_multiple_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="pad_to_multiple_of=8"):
            sft_args(tmp_dir, packing=True, pad_to_multiple_of=8)

    def test_padding_free_wrapped_packing_is_refused(self, tmp_dir):
        with pytest.raises(ValueError, match="neither a packed row nor a sequence"):
            sft_args(tmp_dir, packing=True, packing_strategy="wrapped", padding_free=True)

    def test_an_attention_implementation_not_checked_is_refused(self, tmp_dir):
        trainer = build(tmp_dir, gpt2(), text_data(), packing=True)
        trainer.model.config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
            trainer.train()
        assert trainer.dp_callback.steps == 0

    def test_packing_changed_after_the_trainer_was_built_is_refused(self, tmp_dir):
        trainer = build(tmp_dir, gpt2(), text_data(), packing=True)
        trainer.args.packing = False
        with pytest.raises(ValueError, match="changed after the trainer was built"):
            trainer.train()

    def test_the_config_documents_packing(self):
        assert "packing_strategy='bfd'" in DPSFTConfig.__doc__ and "privacy unit is a sequence" in DPSFTConfig.__doc__
