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
    # Opacus grad_samples spaces
    "dplstm-packed": _TUPLE,
    # private-transformers model settings
    # minimal cases of the silent classes
    "submodule-called-after-root-forward": _TWICE + " (model.head(model(x)))",
}
