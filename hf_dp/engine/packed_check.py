"""The self-check of packed sequences: each checked sequence against itself run alone, unpacked.

In packed mode (:mod:`.packed`) the first-step self-check (DESIGN §4.17) compares, on a few sequences of a real
micro-batch and in eval mode, the engine's per-sequence per-parameter gradient norms of the packed forward pass with
those of plain autograd on the **sequence alone**: its tokens cut out of its row (every ``[rows, tokens, ...]`` input
sliced, TRL's ``cu_seq_lens_*``/``max_length_*``/``seq_idx`` rebuilt for one sequence), as if it had never been
packed. It also compares the sequence's loss in the packed row with its loss alone. So it checks, end to end, what the
engine's first-batch check of the gradients' support cannot: that the model gives each sequence its own positions
(restarting ``position_ids`` read by the position embeddings or rotary tables), that nothing outside the hooked
layers mixes the sequences, and the per-sequence loss itself. The sequences checked are first those that do not start
their row (they have others before them to see), then the others. The tolerances are the self-check's
(:mod:`.self_check`); in training mode the check of :mod:`.self_check` runs as well, on the packed batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..layers import UnsupportedModuleError
from .batch import root_batch
from .packed import Segments, segments_of
from .probe import frozen_rng
from .self_check import SelfCheckError, _compare, _tolerances, _training_mode_norms, grad_norms

__all__ = ["packed_self_check", "solo_batch"]

#: TRL's varlen keys, rebuilt for a sequence alone: cumulative lengths, longest sequence.
_CUMULATIVE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k")
_MAX_LENGTH_KEYS = ("max_length_q", "max_length_k")


def solo_batch(inputs: dict, segments: Segments, sequence: int) -> dict:
    """The inputs of sequence ``sequence`` alone: every ``[rows, tokens, ...]`` tensor (or ``[1, tokens, ...]``)
    cut to its tokens, the varlen keys rebuilt for one sequence of its length, everything else unchanged.

    Raises:
        ValueError: a tensor input the sequence cannot be cut out of.
    """
    row, start, end = segments.bounds[sequence]
    out = {}
    for key, value in inputs.items():
        if key in _CUMULATIVE_KEYS and isinstance(value, Tensor):
            out[key] = torch.tensor([0, end - start], dtype=value.dtype, device=value.device)
        elif key in _MAX_LENGTH_KEYS:
            out[key] = end - start
        elif isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == segments.length:
            if value.shape[0] not in (1, segments.rows):
                raise ValueError(f"Packed self-check: `{key}` of shape {tuple(value.shape)} has no row per row.")
            r = row if value.shape[0] == segments.rows else 0
            cut = value[r : r + 1, start:end]
            out[key] = torch.zeros_like(cut) if key == "seq_idx" else cut
        elif isinstance(value, Tensor) and value.dim() > 0:
            raise ValueError(
                f"Packed self-check: cannot cut one sequence out of `{key}` (shape {tuple(value.shape)}): its "
                f"dimensions are not [rows, tokens] of the packed rows ({segments.rows} x {segments.length})."
            )
        else:
            out[key] = value
    return out


def _checked_sequences(segments: Segments, count: int) -> list[int]:
    """Up to ``count`` sequences: first those that do not start their row, then the others."""
    later = [s for s, (_, start, _) in enumerate(segments.bounds) if start > 0]
    first = [s for s, (_, start, _) in enumerate(segments.bounds) if start == 0]
    return sorted((later + first)[:count])


def packed_self_check(
    clipper, inputs: dict, per_example_loss: Callable[[nn.Module, dict], Tensor], *, num_examples: int = 2
) -> float:
    """Compare ``clipper``'s per-sequence norms of a packed micro-batch with autograd on each sequence alone; see
    ``BookKeepingClipper.self_check``. Returns the largest relative error; raises :class:`SelfCheckError`."""
    if num_examples < 1:
        raise ValueError(f"`num_examples` must be >= 1, got {num_examples}.")
    model: nn.Module = clipper.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    position_ids = inputs.get("position_ids")
    if not isinstance(position_ids, Tensor):
        raise UnsupportedModuleError(
            "Packed self-check: the micro-batch has no `position_ids` tensor, so its sequences cannot be told apart."
        )
    if not trainable:
        return 0.0
    names = {p: n for n, p in model.named_parameters()}
    segments = segments_of(position_ids, root_batch(model, (), inputs).size)
    chosen = _checked_sequences(segments, num_examples)
    tolerances = _tolerances(trainable)
    flags = [(m, m.training) for m in model.modules()]
    devices = sorted({p.device for p in model.parameters()}, key=str)
    packed: dict[str, Tensor] = {}

    def recording(m: nn.Module, batch: dict) -> Tensor:
        packed["loss"] = out = per_example_loss(m, batch)
        return out

    with frozen_rng(devices):
        model.eval()
        try:
            engine = clipper._parameter_norms(inputs, recording)
            with clipper._inert():
                reference = [_alone(model, inputs, segments, s, per_example_loss, trainable) for s in chosen]
        finally:
            for m, flag in flags:
                m.training = flag
    _compare_losses(packed["loss"].detach(), chosen, [loss for loss, _ in reference], tolerances[0])
    selected = {p: v[chosen] for p, v in engine.items()}
    worst = _compare(selected, [norms for _, norms in reference], trainable, names, tolerances, " (packed sequences)")
    if any(flag for _, flag in flags):  # training mode (dropout, ...): the packed batch's own graph, as self_check
        trained = _training_mode_norms(clipper, inputs, per_example_loss, trainable, len(chosen), devices)
        if trained is not None:
            worst = max(worst, _compare(*trained, trainable, names, tolerances, " in training mode"))
    return worst


def _alone(model, inputs, segments, sequence, per_example_loss, trainable) -> tuple[float, dict]:
    """The loss and per-parameter gradient norms of one sequence run alone (plain autograd)."""
    loss = per_example_loss(model, solo_batch(inputs, segments, sequence))
    if loss.shape != (1,):
        raise ValueError(f"`per_example_loss` returned shape {tuple(loss.shape)} for one sequence; expected (1,).")
    grads = torch.autograd.grad(loss.sum(), trainable, allow_unused=True)
    norms = grad_norms(trainable, grads)
    return float(loss.detach().double()), norms


def _compare_losses(packed: Tensor, chosen: list[int], alone: list[float], tolerance: float) -> None:
    """Each checked sequence's loss in its packed row must be its loss alone (else it sees other sequences)."""
    for s, solo in zip(chosen, alone, strict=True):
        got = float(packed[s].double())
        # (a NaN loss in the packed row against a finite one alone is a failure, not a pass)
        if not abs(got - solo) <= tolerance * max(abs(solo), 1e-12) and math.isfinite(solo):
            raise SelfCheckError(
                f"Self-check failed (packed sequences): the loss of sequence {s} in its packed row is {got:.8g}, "
                f"alone {solo:.8g}. The model does not treat the sequences of a packed row as separate sequences "
                "(they attend to each other, or positions do not restart): transformers needs `position_ids` "
                "restarting at each sequence, no `attention_mask`, `use_cache=False` and the 'eager' or 'sdpa' "
                "attention. Train without packing for this model."
            )
