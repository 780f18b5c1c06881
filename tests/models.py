"""The model matrix: tiny models from configs (nothing from the Hub), their batches and per-example losses."""

from __future__ import annotations

import torch
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    T5Config,
    T5ForConditionalGeneration,
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


def causal_batches():
    out = []
    for seed, lengths in enumerate([(10, 7, 10, 4, 9), (6, 10, 8)]):
        ids, mask = padded_ids(lengths, 10, seed=seed)
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


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


def classification_batches():
    out = []
    for seed, lengths in enumerate([(10, 7, 10, 4, 9), (6, 10, 8)]):
        ids, mask = padded_ids(lengths, 10, seed=seed)
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


def mlm_batches(pad_id=0):
    out = []
    for seed, lengths in enumerate([(10, 7, 10, 4, 9), (6, 10, 8)]):
        ids, mask = padded_ids(lengths, 10, pad_id=pad_id, seed=seed)
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


def t5():
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
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        tie_word_embeddings=True,
    )
    model = T5ForConditionalGeneration(cfg)
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:  # indexed by a [T, T] bucket matrix: no per-example batch dim
            p.requires_grad_(False)
    return model


def seq2seq_batches():
    out = []
    for seed, lengths in enumerate([(8, 5, 8, 3), (6, 8, 7)]):
        ids, mask = padded_ids(lengths, 8, seed=seed)
        labels, label_mask = padded_ids([max(2, n - 2) for n in lengths], 6, seed=seed + 5)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(label_mask == 0, -100)})
    return out


def seq2seq_loss(model, batch):
    labels = batch["labels"]
    decoder_input_ids = model._shift_right(labels)
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


# name -> (model factory, batches, loss)
MODEL_MATRIX = {
    "gpt2-tied": (gpt2, causal_batches, causal_loss),
    "gpt2-untied": (lambda: gpt2(tied=False), causal_batches, causal_loss),
    "bert-classifier": (bert_classifier, classification_batches, classification_loss),
    "roberta-mlm": (roberta_mlm, lambda: mlm_batches(pad_id=1), mlm_loss),
    "llama": (llama, causal_batches, causal_loss),
    "t5": (t5, seq2seq_batches, seq2seq_loss),
    "albert-mlm": (albert_mlm, mlm_batches, mlm_loss),
    "gpt2-lora": (gpt2_lora, causal_batches, causal_loss),
    "llama-lora-modules-to-save": (llama_lora, causal_batches, causal_loss),
    "gpt2-prefix": (gpt2_prefix, causal_batches, causal_loss),
    "gpt2-prefix-projection": (lambda: gpt2_prefix(True), causal_batches, causal_loss),
}
