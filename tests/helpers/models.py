"""The model matrix: tiny models from configs (nothing from the Hub), their batches and per-example losses.

Every model is trained as users train it (position tables, relative position biases and tied embeddings trainable,
no dropout so that the float64 oracle compares like with like) and comes in two shapes: micro-batch != sequence
length with padding, and ``-b-eq-t`` where micro-batch == sequence length (== target length for encoder-decoders,
== patches + 1 for vision models), so that no check can tell the batch dimension apart by its size.
"""

from __future__ import annotations

import torch
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    BartConfig,
    BartForConditionalGeneration,
    BeitConfig,
    BeitForImageClassification,
    BertConfig,
    BertForSequenceClassification,
    DeiTConfig,
    DeiTForImageClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MBartConfig,
    MBartForConditionalGeneration,
    OPTConfig,
    OPTForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

from hf_dp.losses import causal_lm_loss, masked_lm_loss, sequence_classification_loss, token_loss

VOCAB = 23  # small, so every sequence repeats token ids


def padded_ids(lengths, seq_len, *, pad_id=0, low=3, seed=0):
    """Right-padded ids and attention mask; ids drawn from a small vocabulary."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, VOCAB, (len(lengths), seq_len), generator=g)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, pad_id)
    return ids, mask


def causal_batches(pad_id=0, shapes=None):
    """Causal-LM micro-batches; ``shapes``: ``[(B, T), ...]`` with full-length rows (default: two padded batches)."""
    out = []
    if shapes is not None:
        for seed, (b, t) in enumerate(shapes):
            ids, mask = padded_ids([t] * b, t, pad_id=pad_id, seed=seed)
            out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
        return out
    for seed, lengths in enumerate([(10, 7, 10, 4, 9), (6, 10, 8)]):
        ids, mask = padded_ids(lengths, 10, pad_id=pad_id, seed=seed)
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


B_EQ_T = [(6, 6), (6, 6)]  # micro-batch == sequence length


def causal_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"], reduction="sum")


def gpt2(tied=True, **kw):
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        **kw,
    )
    return GPT2LMHeadModel(cfg)


def llama():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def bert_classifier():
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=0,
    )
    return BertForSequenceClassification(cfg)


def classification_batches(shapes=None):
    out = []
    plan = [(lengths, 10) for lengths in [(10, 7, 10, 4, 9), (6, 10, 8)]]
    if shapes is not None:
        plan = [((t,) * b, t) for b, t in shapes]
    for seed, (lengths, seq_len) in enumerate(plan):
        ids, mask = padded_ids(lengths, seq_len, seed=seed)
        token_types = torch.zeros_like(ids)
        token_types[:, 5:] = 1
        labels = torch.arange(len(lengths)) % 3
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": token_types * mask, "labels": labels})
    return out


def classification_loss(model, batch):
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    return sequence_classification_loss(model(**kwargs).logits, batch["labels"])


def roberta_mlm():
    cfg = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=20,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
    )
    return RobertaForMaskedLM(cfg)


def albert_mlm():
    cfg = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        pad_token_id=0,
    )
    return AlbertForMaskedLM(cfg)


def mlm_batches(pad_id=0, shapes=None):
    out = []
    plan = [(lengths, 10) for lengths in [(10, 7, 10, 4, 9), (6, 10, 8)]]
    if shapes is not None:
        plan = [((t,) * b, t) for b, t in shapes]
    for seed, (lengths, seq_len) in enumerate(plan):
        ids, mask = padded_ids(lengths, seq_len, pad_id=pad_id, seed=seed)
        g = torch.Generator().manual_seed(seed + 10)
        pick = (torch.rand(ids.shape, generator=g) < 0.4) & (mask == 1)
        pick[:, 1] = True  # every example has a target
        labels = ids.masked_fill(~pick, -100)
        inputs = ids.masked_fill(pick, 2)  # 2 = [MASK]
        out.append({"input_ids": inputs, "attention_mask": mask, "labels": labels})
    return out


def mlm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return masked_lm_loss(logits, batch["labels"], reduction="mean")


def t5(trainable_bias=True, dropout=0.0):
    """T5 with its relative attention bias trainable (indexed by ``[q, k]`` bucket ids, no batch dimension)."""
    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=dropout,
        pad_token_id=0,
        decoder_start_token_id=0,
        tie_word_embeddings=True,
    )
    model = T5ForConditionalGeneration(cfg)
    if not trainable_bias:
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.requires_grad_(False)
    return model


def seq2seq_batches(pad_id=0, shapes=None):
    """``shapes``: ``[(B, source length, target length), ...]`` with full-length rows."""
    out = []
    if shapes is not None:
        for seed, (b, t, s) in enumerate(shapes):
            ids, mask = padded_ids([t] * b, t, pad_id=pad_id, seed=seed)
            labels, _ = padded_ids([s] * b, s, pad_id=pad_id, seed=seed + 5)
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        return out
    for seed, lengths in enumerate([(8, 5, 8, 3), (6, 8, 7)]):
        ids, mask = padded_ids(lengths, 8, pad_id=pad_id, seed=seed)
        labels, label_mask = padded_ids([max(2, n - 2) for n in lengths], 6, pad_id=pad_id, seed=seed + 5)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(label_mask == 0, -100)})
    return out


SEQ2SEQ_B_EQ_T = [(5, 5, 5), (5, 5, 5)]


def seq2seq_loss(model, batch):
    labels = batch["labels"]
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        decoder_input_ids=decoder_input_ids,
    ).logits
    return token_loss(logits, labels, reduction="sum")


def gpt2_lora():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        gpt2(),
        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_dropout=0.0),
    )


def llama_lora():
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
        lora_dropout=0.0,
    )
    model = get_peft_model(llama(), cfg)
    for name, p in model.named_parameters():  # LoRA B starts at zero; move it so every factor is exercised
        if "lora_B" in name or "lora_embedding_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def gpt2_prefix(projection=False):
    from peft import PrefixTuningConfig, get_peft_model

    cfg = PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=3, prefix_projection=projection, encoder_hidden_size=8
    )
    return get_peft_model(gpt2(), cfg)


def bart(tied=True):
    """BART: scaled word embeddings (``BartScaledWordEmbedding``, tied with ``lm_head``) and learned position
    tables (an ``nn.Embedding`` subclass that builds its own ids; the decoder's is ``[1, T, d]``)."""
    cfg = BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        tie_word_embeddings=tied,
    )
    return BartForConditionalGeneration(cfg)


def mbart():
    """mBART: pre-LayerNorm, ``layernorm_embedding``, scaled tied embeddings, and its own decoder-input shift."""
    cfg = MBartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    return MBartForConditionalGeneration(cfg)


def opt(project=False):
    """OPT: the decoder layers reshape hidden states to ``[B*T, d]`` before ``fc1``/``fc2`` (a flattened layout);
    ``project=True``: OPT-350m style (post-LayerNorm, ``project_in``/``project_out``)."""
    cfg = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        ffn_dim=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        word_embed_proj_dim=8 if project else 16,
        do_layer_norm_before=not project,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    return OPTForCausalLM(cfg)


_VISION = {
    "image_size": 8,
    "patch_size": 4,
    "num_channels": 3,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 24,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "num_labels": 3,
}
IMAGE_B_EQ_T = [5, 5]  # 8x8 images, 4x4 patches: 4 patches + [CLS] = 5 positions


def vit():
    return ViTForImageClassification(ViTConfig(**_VISION))


def deit():
    """DeiT: [CLS] and distillation tokens and position embeddings are raw parameters of the embeddings module."""
    return DeiTForImageClassification(DeiTConfig(**_VISION))


def beit(dropout=0.0):
    """BEiT: a relative position bias table per layer (``[1, heads, N, N]``, shared by every example) and layer
    scales (raw parameters read in the layer's forward); ``dropout``: attention dropout and stochastic depth."""
    vision = {**_VISION, "attention_probs_dropout_prob": dropout}
    cfg = BeitConfig(
        **vision,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        layer_scale_init_value=0.1,
        drop_path_rate=dropout,
    )
    return BeitForImageClassification(cfg)


def image_batches(shapes=(4, 3)):
    g = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(b, 3, 8, 8, generator=g), "labels": torch.arange(b) % 3} for b in shapes]


def image_loss(model, batch):
    return sequence_classification_loss(model(pixel_values=batch["pixel_values"]).logits, batch["labels"])


# name -> (model factory, batches, loss)
MODEL_MATRIX = {
    "gpt2-tied": (gpt2, causal_batches, causal_loss),
    "gpt2-untied": (lambda: gpt2(tied=False), causal_batches, causal_loss),
    "bert-classifier": (bert_classifier, classification_batches, classification_loss),
    "roberta-mlm": (roberta_mlm, lambda: mlm_batches(pad_id=1), mlm_loss),
    "llama": (llama, causal_batches, causal_loss),
    "t5": (t5, seq2seq_batches, seq2seq_loss),
    "t5-frozen-bias": (lambda: t5(trainable_bias=False), seq2seq_batches, seq2seq_loss),
    "albert-mlm": (albert_mlm, mlm_batches, mlm_loss),
    "gpt2-lora": (gpt2_lora, causal_batches, causal_loss),
    "llama-lora-modules-to-save": (llama_lora, causal_batches, causal_loss),
    "gpt2-prefix": (gpt2_prefix, causal_batches, causal_loss),
    "gpt2-prefix-projection": (lambda: gpt2_prefix(True), causal_batches, causal_loss),
    "bart-tied": (bart, lambda: seq2seq_batches(pad_id=1), seq2seq_loss),
    "mbart": (mbart, lambda: seq2seq_batches(pad_id=1), seq2seq_loss),
    "opt": (opt, lambda: causal_batches(pad_id=1), causal_loss),
    "opt-350m-style": (lambda: opt(project=True), lambda: causal_batches(pad_id=1), causal_loss),
    "vit": (vit, image_batches, image_loss),
    "deit": (deit, image_batches, image_loss),
    "beit": (beit, image_batches, image_loss),
}

# the same models with micro-batch == sequence length
MODEL_MATRIX_B_EQ_T = {
    "gpt2-tied": (gpt2, lambda: causal_batches(shapes=B_EQ_T), causal_loss),
    "gpt2-untied": (lambda: gpt2(tied=False), lambda: causal_batches(shapes=B_EQ_T), causal_loss),
    "bert-classifier": (bert_classifier, lambda: classification_batches(shapes=B_EQ_T), classification_loss),
    "roberta-mlm": (roberta_mlm, lambda: mlm_batches(pad_id=1, shapes=B_EQ_T), mlm_loss),
    "llama": (llama, lambda: causal_batches(shapes=B_EQ_T), causal_loss),
    "t5": (t5, lambda: seq2seq_batches(shapes=SEQ2SEQ_B_EQ_T), seq2seq_loss),
    "albert-mlm": (albert_mlm, lambda: mlm_batches(shapes=B_EQ_T), mlm_loss),
    "gpt2-lora": (gpt2_lora, lambda: causal_batches(shapes=B_EQ_T), causal_loss),
    "llama-lora-modules-to-save": (llama_lora, lambda: causal_batches(shapes=B_EQ_T), causal_loss),
    "gpt2-prefix": (gpt2_prefix, lambda: causal_batches(shapes=B_EQ_T), causal_loss),
    "bart-tied": (bart, lambda: seq2seq_batches(pad_id=1, shapes=SEQ2SEQ_B_EQ_T), seq2seq_loss),
    "mbart": (mbart, lambda: seq2seq_batches(pad_id=1, shapes=SEQ2SEQ_B_EQ_T), seq2seq_loss),
    "opt": (opt, lambda: causal_batches(pad_id=1, shapes=B_EQ_T), causal_loss),
    "opt-350m-style": (lambda: opt(project=True), lambda: causal_batches(pad_id=1, shapes=B_EQ_T), causal_loss),
    "vit": (vit, lambda: image_batches(IMAGE_B_EQ_T), image_loss),
    "deit": (deit, lambda: image_batches(IMAGE_B_EQ_T), image_loss),
    "beit": (beit, lambda: image_batches(IMAGE_B_EQ_T), image_loss),
}
