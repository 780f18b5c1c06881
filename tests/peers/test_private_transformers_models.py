"""private-transformers' privacy-engine model settings against BookKeepingClipper in float64, every clipping mode.

Their tests cover classification (BERT, RoBERTa, ALBERT), generation (GPT-2, OpenAI GPT, OPT-125m and OPT-350m, each
with tied and untied embeddings) and conditional generation (BART, T5, tied); their supported-model list adds the
GPT-2/OpenAI-GPT double-heads models and ViT. BEiT is added for its relative position bias (issue 17). Here each
is a tiny random model from a config, every parameter trainable (position tables included, as users train them),
no dropout; each comes in two shapes: ``micro-batch != sequence length`` with right padding, and ``-b-eq-t`` where
micro-batch == sequence length (== target length for encoder-decoders, == patches + 1 for vision models).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from harness import Case, check_config, peer_params
from torch import nn

from hf_dp.losses import causal_lm_loss, sequence_classification_loss, token_loss

VOCAB = 29
SMALL = {"vocab_size": VOCAB}


def _ids(lengths: list[int], seq_len: int, g: torch.Generator, pad: int = 0, low: int = 3):
    """Right-padded ids and mask from a small vocabulary (token ids repeat within a sequence)."""
    x = torch.randint(low, VOCAB, (len(lengths), seq_len), generator=g)
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    return x.masked_fill(mask == 0, pad), mask


def _text_batches(shapes, *, pad: int = 0, labels: str = "lm", padded: bool = True, seed: int = 0):
    """One micro-batch per ``(batch, seq_len)``; lengths vary unless ``batch == seq_len`` (then a full batch)."""

    def make() -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for b, t in shapes:
            lengths = [t - (i % 3) for i in range(b)] if padded and b != t else [t] * b
            x, mask = _ids(lengths, t, g, pad=pad)
            batch = {"input_ids": x, "attention_mask": mask}
            if labels == "lm":
                batch["labels"] = x.masked_fill(mask == 0, -100)
            else:
                batch["labels"] = torch.arange(b) % 3
            out.append(batch)
        return out

    return make


def _seq2seq_batches(shapes, *, pad: int = 0, seed: int = 0):
    """``(batch, source len, target len)`` micro-batches with decoder inputs and labels."""

    def make() -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for b, t, s in shapes:
            full = b == t == s
            x, mask = _ids([t] * b if full else [t - (i % 3) for i in range(b)], t, g, pad=pad)
            y, ymask = _ids([s] * b if full else [s - (i % 2) for i in range(b)], s, g, pad=pad)
            out.append({"input_ids": x, "attention_mask": mask, "labels": y.masked_fill(ymask == 0, -100)})
        return out

    return make


def _image_batches(shapes, size: int, seed: int = 0):
    def make() -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [
            {
                "pixel_values": torch.randn(b, 3, size, size, generator=g, dtype=torch.float64),
                "labels": torch.arange(b) % 3,
            }
            for b in shapes
        ]

    return make


def causal_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"], reduction="mean")


def classification_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sequence_classification_loss(logits, batch["labels"])


def seq2seq_loss(model, batch):
    labels = batch["labels"]
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_input_ids
    ).logits
    return token_loss(logits, labels, reduction="mean")


def image_loss(model, batch):
    return sequence_classification_loss(model(pixel_values=batch["pixel_values"]).logits, batch["labels"])


def double_heads_loss(model, batch):
    """LM loss on every choice plus the multiple-choice loss, per example (inputs ``[B, 2 choices, T]``, unpadded)."""
    ids = batch["input_ids"]
    ids = torch.stack([ids, ids.flip(-1)], dim=1)
    mc_token_ids = torch.full(ids.shape[:2], ids.shape[-1] - 1)
    out = model(input_ids=ids, mc_token_ids=mc_token_ids)
    lm = causal_lm_loss(out.logits.flatten(0, 1), ids.flatten(0, 1)).reshape(-1, 2).sum(1)
    mc = sequence_classification_loss(out.mc_logits, torch.zeros(ids.shape[0], dtype=torch.long))
    return lm + mc


def _gpt2_config(tied: bool):
    return tf.GPT2Config(
        **SMALL, n_positions=16, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        summary_first_dropout=0.0, tie_word_embeddings=tied,
    )  # fmt: skip


def _openai_gpt_config(tied: bool):
    return tf.OpenAIGPTConfig(
        **SMALL, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        summary_first_dropout=0.0, tie_word_embeddings=tied,
    )  # fmt: skip


def _opt_config(tied: bool, *, before: bool = True, proj: int | None = None):
    """OPT-125m style (pre-LN); ``before=False, proj=4``: OPT-350m style (post-LN, project_in/project_out)."""
    return tf.OPTConfig(
        **SMALL, hidden_size=8, ffn_dim=12, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16,
        word_embed_proj_dim=proj or 8, do_layer_norm_before=before, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, tie_word_embeddings=tied,
    )  # fmt: skip


_ENCODER = {
    "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 12,
    "max_position_embeddings": 20, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": 3,
}  # fmt: skip


def _bert():
    return tf.BertForSequenceClassification(tf.BertConfig(**SMALL, **_ENCODER, pad_token_id=0))


def _roberta():
    return tf.RobertaForSequenceClassification(tf.RobertaConfig(**SMALL, **_ENCODER, pad_token_id=1))


def _albert():
    cfg = tf.AlbertConfig(
        **SMALL, **{**_ENCODER, "num_hidden_layers": 2}, embedding_size=6, classifier_dropout_prob=0.0, pad_token_id=0
    )
    return tf.AlbertForSequenceClassification(cfg)


def _bart(train_positions: bool = True):
    cfg = tf.BartConfig(
        **SMALL, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=12, decoder_ffn_dim=12, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, classifier_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = tf.BartForConditionalGeneration(cfg)
    if not train_positions:  # private-transformers' own setting (it has no rule for them)
        model.model.encoder.embed_positions.requires_grad_(False)
        model.model.decoder.embed_positions.requires_grad_(False)
    return model


def _t5():
    cfg = tf.T5Config(
        **SMALL, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
        decoder_start_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    return tf.T5ForConditionalGeneration(cfg)


_VISION = {
    "image_size": 8, "patch_size": 4, "num_channels": 3, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 12, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0, "num_labels": 3,
}  # fmt: skip


def _vit():
    return tf.ViTForImageClassification(tf.ViTConfig(**_VISION))


def _beit():
    cfg = tf.BeitConfig(**_VISION, use_relative_position_bias=True, use_mean_pooling=True, layer_scale_init_value=0.1)
    return tf.BeitForImageClassification(cfg)


def _gpt2_checkpointed():
    """GPT-2 with (non-reentrant) gradient checkpointing: the forward is recomputed inside the backward."""
    model = tf.GPT2LMHeadModel(_gpt2_config(True))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _pair(name: str, build, batches, loss_fn, normal, equal, refusable: str | None = None) -> dict[str, Case]:
    """The configuration with micro-batch != sequence length, and its ``-b-eq-t`` twin."""
    return {
        name: Case(build, batches(normal), loss_fn, refusable),
        f"{name}-b-eq-t": Case(build, batches(equal), loss_fn, refusable),
    }


def _configs() -> dict[str, Case]:
    text = [(3, 6), (2, 6)], [(6, 6), (6, 6)]
    out: dict[str, Case] = {}
    for tied, tag in ((True, "tied"), (False, "untied")):
        out |= _pair(
            f"gpt2-{tag}", lambda t=tied: tf.GPT2LMHeadModel(_gpt2_config(t)), _text_batches, causal_loss, *text
        )
        out |= _pair(
            f"openai-gpt-{tag}",
            lambda t=tied: tf.OpenAIGPTLMHeadModel(_openai_gpt_config(t)),
            _text_batches,
            causal_loss,
            *text,
        )
        out |= _pair(
            f"opt-125m-style-{tag}",
            lambda t=tied: tf.OPTForCausalLM(_opt_config(t)),
            lambda s: _text_batches(s, pad=1),
            causal_loss,
            *text,
        )
        out |= _pair(
            f"opt-350m-style-{tag}",
            lambda t=tied: tf.OPTForCausalLM(_opt_config(t, before=False, proj=4)),
            lambda s: _text_batches(s, pad=1),
            causal_loss,
            *text,
        )
    choices = "multiple-choice inputs [B, choices, T] are flattened to [B * choices, T] (refusal is acceptable)"
    out |= _pair(
        "gpt2-doubleheads",
        lambda: tf.GPT2DoubleHeadsModel(_gpt2_config(True)),
        lambda s: _text_batches(s, padded=False),
        double_heads_loss,
        *text,
        refusable=choices,
    )
    out |= _pair(
        "openai-gpt-doubleheads",
        lambda: tf.OpenAIGPTDoubleHeadsModel(_openai_gpt_config(True)),
        lambda s: _text_batches(s, padded=False),
        double_heads_loss,
        *text,
        refusable=choices,
    )
    cls = lambda s, pad=0: _text_batches(s, pad=pad, labels="class")  # noqa: E731
    out |= _pair("bert-cls", _bert, cls, classification_loss, *text)
    out |= _pair("roberta-cls", _roberta, lambda s: cls(s, pad=1), classification_loss, *text)
    out |= _pair("albert-cls", _albert, cls, classification_loss, *text)
    seq2seq = [(3, 6, 5), (2, 6, 5)], [(5, 5, 5), (5, 5, 5)]
    bart_batches = lambda s: _seq2seq_batches(s, pad=1)  # noqa: E731
    out |= _pair("bart-tied", _bart, bart_batches, seq2seq_loss, *seq2seq)
    out |= _pair("bart-tied-frozen-positions", lambda: _bart(False), bart_batches, seq2seq_loss, *seq2seq)
    out |= _pair("t5-tied", _t5, _seq2seq_batches, seq2seq_loss, *seq2seq)
    images = [3, 2], [5, 5]  # 8x8 images, 4x4 patches: 4 patches + [CLS] = 5 positions
    out |= _pair("vit-cls", _vit, lambda s: _image_batches(s, 8), image_loss, *images)
    out |= _pair("beit-cls-relative-position-bias", _beit, lambda s: _image_batches(s, 8), image_loss, *images)
    out["gpt2-tied-gradient-checkpointing"] = Case(
        _gpt2_checkpointed,
        _text_batches(text[0]),
        causal_loss,
        refusable="gradient checkpointing recomputes the forward in the backward (refusal is acceptable)",
    )
    return out


CONFIGS: dict[str, Case] = _configs()


@pytest.mark.parametrize(("config_id", "mode"), peer_params(CONFIGS))
def test_private_transformers_model(config_id, mode):
    check_config(config_id, CONFIGS[config_id], mode)


def test_position_tables_are_trainable():
    """The settings train what users train: position tables and tied embeddings are trainable parameters."""
    for config_id in ("gpt2-tied", "opt-125m-style-tied", "bart-tied", "t5-tied", "beit-cls-relative-position-bias"):
        model = CONFIGS[config_id].build()
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert any(k in n for n in names for k in ("wpe", "embed_positions", "relative_attention_bias", "relative"))
    model: nn.Module = CONFIGS["bart-tied"].build()
    assert model.lm_head.weight is model.model.shared.weight
