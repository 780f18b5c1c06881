"""Packed sequences: several examples in one row, each clipped on its own (``packed_sequences=True``).

TRL's padding-free packing (``packing_strategy="bfd"``) puts several sequences into one row, ``position_ids``
restarting at each sequence and no attention mask, and transformers builds a block-causal mask from those position
ids. With DP the privacy unit is a sequence, so the examples are **segments of rows**: a micro-batch of ``R`` rows of
``T`` tokens holds ``S`` examples, the per-example loss is ``[S]`` and every norm and coefficient is per sequence.

**Which token belongs to which sequence.** The engine reads the ``position_ids`` keyword of the model's call and cuts
the rows with :func:`hf_dp.packed_sequences.packed_sequence_ids` (a sequence starts at the first token of a row and
wherever the position does not grow by exactly 1): the rule transformers' ``find_packed_sequence_indices`` applies to
the same tensor to build the mask, and :func:`~hf_dp.packed_sequences.packed_causal_lm_loss` to cut the losses. A call
without ``position_ids``, or with an ``attention_mask`` (transformers then ignores the boundaries), is refused.

**Per-sequence gradients of token-wise layers.** For a layer whose output at token ``t`` depends on its input at ``t``
alone (``nn.Linear``, HF ``Conv1D``, ``nn.Embedding``, PEFT LoRA, ``nn.LayerNorm``, the RMSNorm family) the gradient
of sequence ``s`` is the sum of the per-token terms of its tokens, ``G_s = sum_{t in s} g_t a_t^T``, so its ghost norm
is the ghost-norm identity with both Gram matrices masked block-diagonally by sequence,
``||G_s||^2 = sum_{t, t' in s} (a_t . a_t')(g_t . g_t')``, and the clipped sum is ``sum_t c_{seq(t)} g_t a_t^T``.
Implementation (exact, and the layer rules stay untouched): the book-kept input and output gradient, ``[R, T, ...]``
(or ``[R*T, ...]``), are re-laid as ``[S, L, ...]`` (``L`` the longest sequence) by a gather of token ``(r, t)`` to
``(sequence, position)``, zeros elsewhere (a zero output gradient adds nothing to the norm nor to the sum), and the
layer's own rule runs with the sequences as the batch. Shared parameters (GPT-2's tied ``wte``/``lm_head``) get their
exact cross terms per sequence as usual, since every use is re-laid the same way.

**What is refused** (naming the module): a trainable module whose rule is not one of these token-wise rules (the
``torch.func`` fallback, convolutions over time, EmbeddingBag, prefix tuning, DoRA, anything the engine cannot prove
token-wise), a hooked tensor whose leading dimensions are not the rows and tokens of ``position_ids``, privacy units
over sequences.

**Sequences must not see each other.** Attention is the one place where tokens mix, and a row's sequences attending
to each other would make the loss of one depend on another. Checked twice: on the first micro-batch of every plan with
two sequences or more, the engine differentiates the loss of single sequences (the first, the last, and the last of
the first row holding several) and refuses if it reaches any hooked output at a token of another sequence (a
transformers model called with its default ``use_cache=True`` builds no block mask and fails here); and the
self-check (``clipper.self_check``) compares each checked sequence's loss and per-parameter gradient norms with those
of the sequence run alone, unpacked (:mod:`.packed_check`): position handling and anything outside the hooked layers.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ..layers import Captured, Layout, ScaledRule, UnsupportedModuleError, lora
from ..layers.conv1d_hf import HFConv1DRule
from ..layers.embedding import EmbeddingRule
from ..layers.grads import PerExampleGrad
from ..layers.layernorm import LayerNormRule
from ..layers.linear import LinearRule
from ..layers.rmsnorm import RMSNormRule
from ..packed_sequences import packed_sequence_ids
from .rows import grad_layout, to_rows
from .state import Pass

logger = logging.getLogger("hf_dp.engine.clipper")

__all__ = ["PackedSequences", "Segments", "packed_grads", "segments_of", "support_examples", "token_dims"]

#: What to do when a packed forward pass cannot be cut into sequences.
_HOW = (
    "Call the model as TRL's padding-free collator does: `position_ids` [rows, tokens] restarting at 0 at each "
    "sequence, no `attention_mask`, `use_cache=False`."
)


@dataclass(frozen=True)
class Segments:
    """The sequences of a packed forward pass: ``rows`` rows of ``length`` tokens hold ``count`` sequences, the
    longest ``width`` tokens; ``slot[r * length + t]`` is ``sequence * width + position`` of token ``(r, t)``;
    ``bounds[s]`` is ``(row, start, end)`` of sequence ``s`` (read on the host)."""

    rows: int
    length: int
    count: int
    width: int
    slot: Tensor
    bounds: tuple[tuple[int, int, int], ...]

    def relay(self, x: Tensor, feature_dims: int, what: str) -> Tensor:
        """``x`` (``[R, T, *rest]`` or ``[R*T, *rest]``, ``rest`` ending in ``feature_dims`` feature dimensions) as
        ``[S, L, *rest]``: each token moved to its sequence and position, zeros elsewhere."""
        lead = next((j for j in range(x.dim() + 1) if math.prod(x.shape[:j]) >= self.rows * self.length), None)
        tokens = tuple(x.shape[:lead]) if lead is not None else None
        if tokens not in ((self.rows, self.length), (self.rows * self.length,)) or x.dim() - lead < feature_dims:
            raise UnsupportedModuleError(
                f"{what} has shape {tuple(x.shape)}, whose leading dimensions are not the {self.rows} row(s) of "
                f"{self.length} tokens of the packed `position_ids`: hf_dp cannot tell which of its entries belong to "
                "which sequence. Freeze that module's parameters, or train without packing."
            )
        rest = x.shape[lead:]
        out = x.new_zeros(self.count * self.width, *rest)
        out[self.slot.to(out.device)] = x.reshape(self.rows * self.length, *rest)
        return out.view(self.count, self.width, *rest)

    def foreign(self, grad: Tensor, layout: Layout, rows: int, example: int, entry) -> Tensor:
        """How many entries of ``grad`` (the gradient of sequence ``example``'s loss alone at the output of hooked
        ``entry``) are non-zero at tokens of other sequences (a 0-dim integer tensor; non-finite entries ignored, as
        for rows)."""
        dims = token_dims(entry.rule, entry.module)
        if dims is None:
            raise not_token_wise(entry)
        g = self.relay(to_rows(grad, grad_layout(layout), rows), dims[1], f"The output of `{entry.name}`")
        others = torch.cat([g[:example].reshape(-1), g[example + 1 :].reshape(-1)])
        return ((others != 0) & torch.isfinite(others)).sum()


def segments_of(position_ids: Tensor, rows: int) -> Segments:
    """The sequences of a packed call whose ``position_ids`` are ``[rows, T]`` (or ``[1, T]``, broadcast)."""
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, rows):
        raise UnsupportedModuleError(
            f"packed sequences: `position_ids` of shape {tuple(position_ids.shape)} for {rows} row(s). {_HOW}"
        )
    position_ids = position_ids.expand(rows, -1)
    length = position_ids.shape[1]
    sequence = packed_sequence_ids(position_ids).reshape(-1)
    starts = torch.ones_like(sequence, dtype=torch.bool)
    starts[1:] = sequence[1:] != sequence[:-1]
    first = torch.nonzero(starts).flatten()
    flat_starts = first.tolist()  # the one host read of a packed pass: where each sequence starts
    ends = [*flat_starts[1:], rows * length]
    width = max(e - s for s, e in zip(flat_starts, ends, strict=True)) if flat_starts else 0
    position = torch.arange(sequence.numel(), device=sequence.device) - first[sequence]
    bounds = tuple((s // length, s % length, s % length + e - s) for s, e in zip(flat_starts, ends, strict=True))
    return Segments(rows, length, len(flat_starts), width, sequence * width + position, bounds)


def token_dims(rule, module: nn.Module) -> tuple[int, int] | None:
    """``(input, output)`` feature dimensions of a token-wise rule (its op acts on each token alone, its parameter
    gradient is a sum over tokens), or ``None`` for any other rule (exact types: a subclass may do otherwise)."""
    if isinstance(rule, ScaledRule):
        return token_dims(rule.base, module)
    kind = type(rule)
    if kind in (LinearRule, HFConv1DRule):
        return 1, 1
    if kind is EmbeddingRule or kind is getattr(lora, "LoraEmbeddingRule", None):
        return 0, 1
    if kind is LayerNormRule:
        return len(module.normalized_shape), len(module.normalized_shape)
    if kind is RMSNormRule:
        return module.weight.dim(), module.weight.dim()
    return None


def packed_grads(
    entry, captured: Captured, grad_output: Tensor, layout: Layout, rows: int, segments: Segments, trainable: set
) -> dict[nn.Parameter, PerExampleGrad]:
    """Per-sequence gradients of one call of a token-wise module: its rule on the input and output gradient re-laid
    as ``[S, L, ...]`` (the sequences as the batch)."""
    dims = token_dims(entry.rule, entry.module)
    if dims is None:  # refused when the plan was checked; kept here so that no other rule ever sees packed rows
        raise not_token_wise(entry)
    what = f"The input of `{entry.name}`"
    x = segments.relay(to_rows(captured.args[0], layout, rows), dims[0], what)
    g = segments.relay(to_rows(grad_output, grad_layout(layout), rows), dims[1], f"The output gradient of {what[4:]}")
    return entry.rule.per_example_grads(entry.module, replace(captured, args=(x, *captured.args[1:])), g, trainable)


def not_token_wise(entry) -> UnsupportedModuleError:
    """The refusal of a trainable module that is not token-wise, in packed mode."""
    return UnsupportedModuleError(
        f"Packed sequences: `{entry.name}` ({type(entry.module).__name__}, rule {type(entry.rule).__name__}) is not "
        "a token-wise layer (Linear, HF Conv1D, Embedding, LoRA, LayerNorm, RMSNorm), so hf_dp cannot prove that its "
        "gradient splits into the gradients of the sequences of a packed row. Freeze its parameters, or train "
        "without packing (one sequence per row)."
    )


def support_examples(p) -> list[int]:
    """The examples whose losses the first-batch check differentiates alone: the first and the last, and in packed
    mode also the last sequence of the first row that holds several (whose tokens could attend to the others)."""
    segments = p.segments
    if segments is None:
        return sorted({0, p.size - 1})
    last_of_row: dict[int, int] = {}
    for s, (row, _, _) in enumerate(segments.bounds):
        last_of_row[row] = s
    crowded = [s for s, (row, start, _) in enumerate(segments.bounds) if start > 0 and last_of_row[row] == s]
    return sorted({0, segments.count - 1, *crowded[:1]})


def crossing_error(modules: list[str]) -> UnsupportedModuleError:
    """The refusal when the loss of one sequence reaches another sequence's tokens."""
    shown = f"{modules[:3]}{' ...' if len(modules) > 3 else ''}"
    return UnsupportedModuleError(
        f"Packed sequences: the loss of one sequence depends on the tokens of other sequences of its row in the "
        f"outputs of {shown}: the sequences attend to each other, so no per-sequence bound holds. transformers "
        "builds a block-causal mask from restarting `position_ids` only with no `attention_mask`, no cache "
        "(`use_cache=False`) and an attention implementation that takes the mask ('eager', 'sdpa'); some model "
        "types build their own masks. Call the model that way, or train without packing (one sequence per row)."
    )


class PackedSequences:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: the sequences of each packed forward pass."""

    packed_sequences: bool = False

    def _start_packed(self, kwargs: dict, rows: int) -> None:
        """At the start of a forward pass with gradients: cut the rows into sequences (refused: a call that cannot
        be cut, a plan with a module that is not token-wise). A forward pass that no ``prepare()`` consumed is
        dropped (its sequences are not this one's)."""
        p = self._pass
        if p.uses:  # a forward pass no `prepare()` consumed: its sequences are not this one's
            logger.warning("hf_dp: a packed forward pass follows one that no `prepare()` consumed; it is dropped.")
            p = self._pass = Pass(p.batch, ghost_diff=p.ghost_diff)
        position_ids = kwargs.get("position_ids")
        if not isinstance(position_ids, Tensor):
            raise UnsupportedModuleError(f"Packed sequences: the model was called without `position_ids`. {_HOW}")
        if kwargs.get("attention_mask") is not None:
            raise UnsupportedModuleError(
                "Packed sequences: the model was called with an `attention_mask`, with which transformers ignores "
                f"the sequence boundaries of `position_ids` (the sequences would attend to each other). {_HOW}"
            )
        p.segments = segments_of(position_ids, rows)
        if self._packed_plan is not self._plan:
            for entry in self._plan.hooked:
                if entry.is_fallback or entry.promoted or token_dims(entry.rule, entry.module) is None:
                    raise not_token_wise(entry)
            self._packed_plan = self._plan
