"""QLoRA (issue 38): a 4-bit bitsandbytes base (nf4) with LoRA on every linear layer, as users load it (a model saved
and reloaded with ``BitsAndBytesConfig(load_in_4bit=True)``, ``peft.prepare_model_for_kbit_training``, LoRA
``all-linear``), in each compute dtype, with and without gradient checkpointing, on CPU.

The oracle is plain autograd through the same quantized model, one example at a time (a batch of one), its gradients
kept in float32 and summed in float64. The base layers compute in the compute dtype, so a batch of one rounds
differently from the batch the engine sees; the tolerance is that dtype's (``ONE_AT_A_TIME_REL``). The engine is also
compared, far tighter, with the per-example gradients of the batch it ran (``autograd.grad`` of each example's loss,
gradient checkpointing off): there only the engine's own float32 arithmetic differs.

The widths are multiples of 64, as real models' are: on a CPU with AVX512-BF16, bitsandbytes repacks such a layer's
weight in place when the model runs in eval mode without gradients (hf_dp's layout proof does), after which its
backward is wrong; the engine keeps the repacking off (``hf_dp/engine/bnb_packing.py``).
"""

from __future__ import annotations

import pytest
import torch

from hf_dp import BookKeepingClipper, UnsupportedModuleError


def _bnb_reason() -> str | None:
    """Why 4-bit bitsandbytes cannot run here (``None``: it can)."""
    try:
        import bitsandbytes as bnb
    except Exception as err:  # noqa: BLE001  (any import failure: skip with it)
        return f"bitsandbytes is not importable ({type(err).__name__}: {err})"
    try:
        layer = bnb.nn.Linear4bit(64, 64, quant_type="nf4", compute_dtype=torch.float32).to("cpu")  # quantizes it
        x = torch.randn(2, 64, requires_grad=True)
        layer(x).sum().backward()
        assert layer.weight.bnb_quantized and x.grad is not None
    except Exception as err:  # noqa: BLE001  (no CPU backend in this build)
        return f"bitsandbytes cannot run 4-bit layers on CPU here ({type(err).__name__}: {err})"
    return None


_REASON = _bnb_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Relative tolerance against the one-example-at-a-time oracle: the base layers round in the compute dtype, and a
#: batch of one takes other roundings than the engine's batch.
ONE_AT_A_TIME_REL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
#: Against the per-example gradients of the engine's own batch: only the engine's float32 arithmetic differs.
SAME_BATCH_REL = 1e-5


def llama64():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=23,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def gpt2_64(vocab_size: int = 23):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return GPT2LMHeadModel(cfg)


FACTORIES = {"llama": llama64, "gpt2": gpt2_64}


def quantized(factory, tmp_path, compute_dtype: torch.dtype):
    """The float model saved and reloaded in 4-bit nf4 (offline: from the folder)."""
    from transformers import BitsAndBytesConfig

    torch.manual_seed(0)
    model = factory()
    folder = tmp_path / f"{type(model).__name__}-float"
    if not folder.exists():
        model.save_pretrained(folder)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    return type(model).from_pretrained(folder, quantization_config=bnb, dtype=torch.float32)


def qlora(factory, tmp_path, compute_dtype: torch.dtype, checkpointing: bool):
    """``prepare_model_for_kbit_training`` and LoRA on every linear layer (B moved off zero, so that every factor has
    a gradient); deterministic, so that two calls build the same model."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(
        quantized(factory, tmp_path, compute_dtype), use_gradient_checkpointing=checkpointing
    )
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    model.train()
    return model


def batch():
    from helpers.models import causal_batches

    return causal_batches()[0]  # 5 examples of 10 tokens, 3 of them padded


def loss_fn(model, b):
    from helpers.trainer import causal_per_example_loss

    return causal_per_example_loss(model, b)


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def one_at_a_time(model, b) -> list[list[torch.Tensor]]:
    """Each example's gradients from a forward of that example alone (its padding cut off), float64."""
    grads = []
    for i in range(b["input_ids"].shape[0]):
        n = int(b["attention_mask"][i].sum())
        one = {k: v[i : i + 1, :n] for k, v in b.items()}
        model.zero_grad(set_to_none=True)
        loss_fn(model, one).sum().backward()  # .backward(): reentrant checkpointing has no autograd.grad
        grads.append([p.grad.detach().double().clone() for _, p in trainable(model)])
    model.zero_grad(set_to_none=True)
    return grads


def same_batch(model, b) -> list[list[torch.Tensor]]:
    """Each example's gradients from the batch forward (``autograd.grad`` of its own loss), float64."""
    params = [p for _, p in trainable(model)]
    loss = loss_fn(model, b)
    return [[g.double() for g in torch.autograd.grad(loss[i], params, retain_graph=True)] for i in range(len(loss))]


def clipped(grads, c):
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
    coef = (c / (norms + 1e-6)).clamp(max=1.0)
    return norms, [sum(coef[i] * grads[i][k] for i in range(len(grads))) for k in range(len(grads[0]))]


def _flags(model) -> dict[str, bool]:
    """bitsandbytes' repack-for-CPU-inference flag of every 4-bit layer."""
    return {
        n: m.support_avx512bf16_for_cpu for n, m in model.named_modules() if hasattr(m, "support_avx512bf16_for_cpu")
    }


def assert_close(got, expected, rel, what):
    err = float((got.double() - expected).norm() / expected.norm())
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel:g}"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(FACTORIES))
def test_qlora_per_example_gradients_are_exact(tmp_path, name, dtype, checkpointing):
    compute = DTYPES[dtype]
    b = batch()
    reference = qlora(FACTORIES[name], tmp_path, compute, checkpointing=False)
    tight = same_batch(reference, b)
    loose = one_at_a_time(reference, b)
    c = float(clipped(loose, 1.0)[0].median())  # some examples clipped, some not
    model = qlora(FACTORIES[name], tmp_path, compute, checkpointing=checkpointing)
    for (n, p), (_, q) in zip(trainable(model), trainable(reference), strict=True):
        assert torch.equal(p, q), n
    assert checkpointing == any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode="bk-mixopt")
    clipper.backward(loss_fn(model, b))
    for grads, rel, what in ((tight, SAME_BATCH_REL, "same batch"), (loose, ONE_AT_A_TIME_REL[compute], "one by one")):
        norms, expected = clipped(grads, c)
        assert_close(clipper.per_example_norms, norms, rel, f"{what}: per-example norms")
        for (n, p), e in zip(trainable(model), expected, strict=True):
            assert_close(p.grad, e, rel, f"{what}: {n}")
    assert not any(_flags(model).values())  # off while the clipper is attached
    clipper.remove()
    assert _flags(model) == _flags(reference)  # restored


def test_a_weight_bitsandbytes_repacked_for_cpu_inference_is_refused(tmp_path):
    """An eval-mode forward without gradients repacks the 4-bit weights on a CPU with AVX512-BF16; the backward
    through them is then wrong in bitsandbytes, so the engine refuses, naming the layer, and changes nothing."""
    model = qlora(llama64, tmp_path, torch.float32, checkpointing=False)
    b = batch()
    model.eval()
    with torch.no_grad():
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    model.train()
    repacked = [
        n
        for n, m in model.named_modules()
        if n in _flags(model) and getattr(m.weight.quant_state, "packing_format_for_cpu", False)
    ]
    if not repacked:
        pytest.skip("bitsandbytes does not repack 4-bit weights on this CPU (no AVX512-BF16)")
    flags = _flags(model)
    with pytest.raises(UnsupportedModuleError, match="bitsandbytes' CPU inference layout") as info:
        BookKeepingClipper(model, max_grad_norm=1.0)
    assert f"`{repacked[0]}`" in str(info.value)
    assert _flags(model) == flags
    assert all(p.grad is None for p in model.parameters())


def _expected_step(grads, n_examples):
    """C (the median norm) and the SGD update ``-(1/N) sum_i clip(g_i)``."""
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
    c = float(norms.median())
    assert (norms > c).any() and (norms < c).any()
    return c, [-s / n_examples for s in clipped(grads, c)[1]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_dp_trainer_step_is_exact(tmp_path, dtype):
    """sigma = 0, q = 1, SGD lr = 1, gradient checkpointing on: the update is ``-(1/N) sum_i clip(g_i)``."""
    from helpers.trainer import ToyDataset, collate, sgd_step_args

    from hf_dp import DPTrainer

    compute = DTYPES[dtype]
    data = ToyDataset(8)
    model = qlora(llama64, tmp_path, compute, checkpointing=True)
    reference = qlora(llama64, tmp_path, compute, checkpointing=False)
    examples = collate([data[i] for i in range(len(data))])
    c, expected = _expected_step(one_at_a_time(reference, examples), len(data))
    args = sgd_step_args(
        str(tmp_path / "out"), per_sample_max_grad_norm=c, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    before = [p.detach().clone() for _, p in trainable(model)]
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collate)
    assert trainer.sample_rate == 1.0
    trainer.train()
    assert trainer.dp_callback.steps == 1
    for (n, p), b, e in zip(trainable(model), before, expected, strict=True):
        assert_close(p.detach() - b, e, ONE_AT_A_TIME_REL[compute], n)


class _OptimizerGradients:
    """A ``TrainerCallback`` keeping (float64) the gradients the optimizer steps on: noise 0, so the clipped sum / N."""

    def __new__(cls, params):
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            def __init__(self):
                self.grads = None

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                self.grads = [p.grad.detach().double().clone() for p in params]

        return Keep()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_dp_sft_trainer_step_is_exact(tmp_path, dtype):
    """TRL's QLoRA recipe: the 4-bit model and ``peft_config`` (TRL prepares the model for k-bit training, gradient
    checkpointing on by default, and casts the LoRA factors to bf16); one step's gradient equals
    ``(1/N) sum_i clip(g_i)`` over TRL's rows. The LoRA factors and their gradients are bf16 whatever the compute
    dtype, so the tolerance is bf16's, and the gradient is compared where the optimizer reads it: ``p_new - p_old``
    of a bf16 parameter would add the rounding of ``p`` itself (an ulp of ``p`` is far above a step's size)."""
    pytest.importorskip("trl")
    from peft import LoraConfig
    from trainers.test_trl import WORDS, row_loss, sft_args, text_data, tokenizer

    from hf_dp.trl import DPSFTTrainer

    model = quantized(lambda: gpt2_64(len(WORDS)), tmp_path, DTYPES[dtype])
    torch.manual_seed(1)
    trainer = DPSFTTrainer(
        model=model,
        args=sft_args(str(tmp_path / "out")),
        train_dataset=text_data(),
        processing_class=tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    )
    model = trainer.model
    assert trainer.args.gradient_checkpointing
    assert {p.dtype for _, p in trainable(model)} == {torch.bfloat16}  # TRL's QLoRA cast
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    rows = trainer.train_dataset
    grads = []
    for i in range(len(rows)):
        model.zero_grad(set_to_none=True)
        row_loss(model, rows[i]).backward()
        grads.append([p.grad.detach().double().clone() for _, p in trainable(model)])
    model.zero_grad(set_to_none=True)
    c, expected = _expected_step(grads, len(rows))
    trainer.args.per_sample_max_grad_norm = c
    keep = _OptimizerGradients([p for _, p in trainable(model)])
    trainer.add_callback(keep)
    trainer.train()
    assert trainer.dp_callback.steps == 1 and keep.grads is not None
    for (n, _), g, e in zip(trainable(model), keep.grads, expected, strict=True):
        assert_close(g, -e, ONE_AT_A_TIME_REL[torch.bfloat16], n)
