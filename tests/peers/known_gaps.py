"""Peer configurations that are silently wrong, crash, or are wrongly refused by today's engine (issue 17).

Key: ``"<config>@<mode>"`` (one clipping mode) or ``"<config>"`` (every mode); value: one line saying why.
Tests listed here are ``xfail(strict=True)``: remove the entry when the engine is fixed (that is the only edit
anyone else makes in tests/peers/). Recorded against the engine of commit d8d0c5c (hf_dp/engine and hf_dp/layers
unchanged since dacb302), 2026-12-01. ``.venv/bin/python tests/peers/report.py`` prints every configuration's
outcome; ``report.py --gaps`` lists failing rows missing here and entries whose rows now pass.
"""

_WRONG_TIED = "WRONG: tied weight, other user is an nn.Embedding subclass (fallback): its use is dropped, norms low"
_WRONG_FUNCTIONAL = "WRONG: weight used outside a hooked module's forward gets no per-example gradient, norms low"
_WRONG_B_EQ_T = "WRONG: batch check fooled by equal sizes (first dim == micro-batch), examples mixed"
_WRONG_BATCH_SECOND = "WRONG: batch-second [T, B, d] with T == B passes the batch check (refusal would be fine)"
_TUPLE = "REFUSED, required: tuple-returning module ('returned tuple; hf_dp hooks modules that return one tensor')"
_OPT = "REFUSED, required: OPT reshapes hidden states to [B*T, d] before fc1/fc2 (batch check on fc2)"
_EMBBAG = "CRASH, required: EmbeddingBag with offsets goes to the torch.func fallback, which splits offsets per example"
_ROOT = "CRASH, required: a fallback module used as the root model (torch.func error: requires_grad_ inside vmap)"
_GRAPH = "GRAPH: numbers exact, but p.grad carries an autograd graph (from the book-kept factors; DESIGN 16)"
_TWICE = "WRONG: uses outside the one root forward the engine book-keeps are dropped or mis-summed"
_CHECKPOINT = "CRASH (refusal would be fine): torch CheckpointError, recomputed tensors' metadata differ"
_EMPTY_GHOST = (
    "WRONG: ghost mode loses the sum accumulated so far at an empty micro-batch (p.grad cleared, not restored)"
)
_DOUBLE_HEADS = "CRASH (refusal would be fine): position ids expanded to B while the model runs on B * choices"

KNOWN_GAPS: dict[str, str] = {
    # exact numbers, but p.grad keeps a graph (bk / bk-mixopt modes)
    "dpmha-batch-first@bk": _GRAPH,
    "dpmha-nobias@bk": _GRAPH,
    "dpmha-kdim-vdim@bk": _GRAPH,
    "dpmha-coincide@bk": _GRAPH,
    "stack-text@bk": _GRAPH,
    "stack-text@bk-mixopt": _GRAPH,
    "stack-text-coincide@bk": _GRAPH,
    "gpt2-tied@bk": _GRAPH,
    "gpt2-tied@bk-mixopt": _GRAPH,
    "gpt2-tied-b-eq-t@bk": _GRAPH,
    "gpt2-tied-b-eq-t@bk-mixopt": _GRAPH,
    "openai-gpt-tied@bk": _GRAPH,
    "openai-gpt-tied@bk-mixopt": _GRAPH,
    "openai-gpt-tied-b-eq-t@bk": _GRAPH,
    "openai-gpt-tied-b-eq-t@bk-mixopt": _GRAPH,
    "gpt2-untied@bk": _GRAPH,
    "gpt2-untied@bk-mixopt": _GRAPH,
    "gpt2-untied-b-eq-t@bk": _GRAPH,
    "gpt2-untied-b-eq-t@bk-mixopt": _GRAPH,
    "openai-gpt-untied@bk": _GRAPH,
    "openai-gpt-untied@bk-mixopt": _GRAPH,
    "openai-gpt-untied-b-eq-t@bk": _GRAPH,
    "openai-gpt-untied-b-eq-t@bk-mixopt": _GRAPH,
    "bert-cls@bk": _GRAPH,
    "bert-cls@bk-mixopt": _GRAPH,
    "bert-cls-b-eq-t@bk": _GRAPH,
    "bert-cls-b-eq-t@bk-mixopt": _GRAPH,
    "roberta-cls@bk": _GRAPH,
    "roberta-cls@bk-mixopt": _GRAPH,
    "roberta-cls-b-eq-t@bk": _GRAPH,
    "roberta-cls-b-eq-t@bk-mixopt": _GRAPH,
    "albert-cls@bk": _GRAPH,
    "albert-cls@bk-mixopt": _GRAPH,
    "albert-cls-b-eq-t@bk": _GRAPH,
    "albert-cls-b-eq-t@bk-mixopt": _GRAPH,
    "vit-cls@bk": _GRAPH,
    "vit-cls@bk-mixopt": _GRAPH,
    "vit-cls-b-eq-t@bk": _GRAPH,
    "vit-cls-b-eq-t@bk-mixopt": _GRAPH,
    "tied-plain-embedding@bk": _GRAPH,
    "tied-plain-embedding@bk-mixopt": _GRAPH,
    # Opacus grad_samples spaces
    "linear-empty-microbatch@ghost": _EMPTY_GHOST,
    "conv2d-empty-microbatch@ghost": _EMPTY_GHOST,
    "linear-batch-second-coincide": _WRONG_BATCH_SECOND,
    "dpmha-batch-second-coincide": _WRONG_BATCH_SECOND,
    "embbag-offsets-sum": _EMBBAG,
    "embbag-offsets-mean": _EMBBAG,
    "embbag-offsets-max": _EMBBAG,
    "embbag-offsets-weights": _EMBBAG,
    "embbag-offsets-padding-idx": _EMBBAG,
    "embbag-offsets-coincide": _EMBBAG,
    "instancenorm1d-affine-running-stats": "CRASH: fallback vmaps in-place running-stat updates (refusal is fine)",
    "dprnn-1layer": _TUPLE,
    "dprnn-2layers-bidirectional": _TUPLE,
    "dpgru-nobias": _TUPLE,
    "dpgru-bidirectional": _TUPLE,
    "dplstm-1layer": _TUPLE,
    "dplstm-2layers": _TUPLE,
    "dplstm-coincide": _TUPLE,
    "dplstm-packed": _TUPLE,
    "dpmha-bias-kv-zero-attn": "REFUSED, required: DPMHA(batch_first=True) runs SequenceBias on [T, B, d] inside",
    "torch-mha-batch-first": _TUPLE,
    "torch-mha-nobias": _TUPLE,
    "torch-mha-bias-kv-zero-attn": _TUPLE,
    "torch-mha-kdim-vdim": _TUPLE,
    "torch-mha-coincide": _TUPLE,
    "sequence-bias-as-root": _ROOT,
    # private-transformers model settings
    "opt-125m-style-tied": _OPT,
    "opt-125m-style-tied-b-eq-t": _OPT,
    "opt-125m-style-untied": _OPT,
    "opt-125m-style-untied-b-eq-t": _OPT,
    "opt-350m-style-tied": _OPT,
    "opt-350m-style-tied-b-eq-t": _OPT,
    "opt-350m-style-untied": _OPT,
    "opt-350m-style-untied-b-eq-t": _OPT,
    "gpt2-doubleheads": _DOUBLE_HEADS,
    "gpt2-doubleheads-b-eq-t": _DOUBLE_HEADS,
    "openai-gpt-doubleheads": _DOUBLE_HEADS,
    "openai-gpt-doubleheads-b-eq-t": _DOUBLE_HEADS,
    "bart-tied": "REFUSED, required: trainable BartLearnedPositionalEmbedding returns [1, T, d] (no batch dim)",
    "bart-tied-b-eq-t": "REFUSED, required: trainable BartLearnedPositionalEmbedding returns [1, T, d] (no batch dim)",
    "bart-tied-frozen-positions": _WRONG_TIED + " (BartScaledWordEmbedding + lm_head)",
    "bart-tied-frozen-positions-b-eq-t": _WRONG_TIED + " (BartScaledWordEmbedding + lm_head)",
    "t5-tied": "REFUSED, required: trainable T5 relative_attention_bias, ids [q, k] have no batch dim",
    "t5-tied-b-eq-t": _WRONG_B_EQ_T + " (T5 relative_attention_bias ids [q, k] with q == B)",
    "beit-cls-relative-position-bias": "REFUSED, required: BEiT relative position bias table, output has no batch dim",
    "beit-cls-relative-position-bias-b-eq-t": "REFUSED, required: BEiT relative position bias table, no batch dim",
    # minimal cases of the silent classes
    "tied-scaled-embedding-subclass": _WRONG_TIED,
    "tied-unscaled-embedding-subclass": _WRONG_TIED,
    "qk-table-b-ne-q": "REFUSED, required: an nn.Embedding looked up by [q, k] ids shared by every example",
    "qk-table-b-eq-q": _WRONG_B_EQ_T + " ([q, k] table with q == B)",
    "batch-second-linear-t-eq-b": _WRONG_BATCH_SECOND,
    "transposed-inside-t-eq-b": _WRONG_BATCH_SECOND,
    "functional-tied-lm-head": _WRONG_FUNCTIONAL + " (F.linear(h, embed.weight))",
    "functional-reuse-of-hooked-weight": _WRONG_FUNCTIONAL,
    "functional-only-use-of-linear": _WRONG_FUNCTIONAL + " (the module is never called: no gradient at all)",
    "rule-by-name-forward-differs": "WRONG: name-matched RMSNorm rule assumes y = xhat * w; module does xhat * w^2",
    "tuple-returning-module": _TUPLE,
    "fallback-module-as-root": _ROOT,
    "submodule-called-after-root-forward": _TWICE + " (model.head(model(x)))",
    "two-root-forwards-per-step": _TWICE + " (two forwards, one backward)",
    "gpt2-tied-gradient-checkpointing@bk": _CHECKPOINT,
    "gpt2-tied-gradient-checkpointing@bk-mixopt": _CHECKPOINT,
    "gpt2-tied-gradient-checkpointing@per-sample": _CHECKPOINT,
}
