"""Outputs computed once for the whole batch and copied along it downstream (peft prompt tuning, p-tuning, CPT).

peft computes a prompt once, ``[1, n, d]`` from ``[1, n]`` virtual-token ids, and ``repeat``\\ s it over the batch
before concatenating it to the input embeddings. Expanding such an output to the batch at the module, as the engine
does for HF's ``[1, T]`` position embeddings (added to the batch), would make that ``repeat`` copy the batch ``B``
times; the plan defers these outputs instead (:meth:`~.proof.PlanProof._prove_expansions`): the module's output
stays as it is, and the engine hooks the copies the model makes of it along the batch.

The identity. Let ``y`` be a deferred output and ``s`` a ``[1, ...]`` tensor computed from it (``y`` itself, or the
output of the modules after it: p-tuning's MLP or LSTM head) that the model copies along the batch, ``z = s.repeat(B
* k, ...)`` (or ``expand``, ``expand_as``, ``broadcast_to``, ``tile``, ``repeat_interleave``: :func:`batch_copy`).
Example ``i``'s copy is rows ``i*k .. i*k+k-1`` of ``z``, and only loss ``i`` reads them (the first batch's check,
:meth:`~.backward.BackwardBookkeeping._support_check`), so ``dL_i/ds`` is the vector-Jacobian product of the copy op
on those rows of ``dL/dz`` (the sum of the copies), and ``dL_i/dy = J_{s,y}^T dL_i/ds``: one ``autograd.grad`` over
the ``B`` copies (``is_grads_batched``) through the few ops between ``y`` and ``s``. To the rules, the output then looks
expanded to the batch, as any ``[1, ...]`` output the engine expands: the closed forms with the batch being the ``B``
copies of the shared input, the fallback re-run on it with each copy's gradient.

Exact or refused: at every backward pass ``sum_i dL_i/dy`` must equal the gradient autograd brings to ``y``; a path
from ``y`` to the loss that is no copy hf_dp saw (``y + x`` broadcast over a batch, a copy inside a checkpointed
region's recomputation) makes them differ, and the backward pass raises, naming the module. The copies are seen by a
:class:`~torch.overrides.TorchFunctionMode` that is on only in forward passes of two or more examples with a deferred
output, from that output to the end of the forward pass.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layers import UnsupportedModuleError
from .checkpointing import graph_task_id
from .probe import run_expanded, tolerance
from .state import Use

__all__ = ["BatchCopy", "CopyTaint", "SharedOutputs", "batch_copy", "copied_calls"]

#: The torch functions that copy a tensor along a new or size-1 dimension 0: how each names its sizes.
_REPEATS = {torch.Tensor.repeat: "repeats", torch.Tensor.tile: "dims", torch.tile: "dims"}
_EXPANDS = {torch.Tensor.expand: "size", torch.Tensor.broadcast_to: "size", torch.broadcast_to: "size"}
_INTERLEAVES = {torch.Tensor.repeat_interleave, torch.repeat_interleave}
COPY_FUNCTIONS = frozenset({*_REPEATS, *_EXPANDS, *_INTERLEAVES, torch.Tensor.expand_as})


@dataclass(frozen=True, eq=False)
class BatchCopy:
    """``source`` copied along dimension 0 of the result: ``kind`` ``"repeat"`` (``sizes``: the repeat factors) or
    ``"expand"`` (``sizes``: the result's shape), with ``shape`` the source's shape with leading ones to the result's
    rank (``shape[0] == 1``)."""

    source: Tensor
    kind: str
    shape: tuple[int, ...]
    sizes: tuple[int, ...]

    def per_copy(self, grad: Tensor, batch_size: int) -> Tensor:
        """``[B, *source.shape]``: the gradient of the source through example ``i``'s rows of the copy alone (the
        vector-Jacobian product of the copy op: the sum of the copies), for each ``i``."""
        g = grad.unflatten(0, (batch_size, grad.shape[0] // batch_size)).sum(1)
        if self.kind == "repeat":
            # a repeat tiles dimension d as sizes[d] blocks of shape[d]: sum the blocks
            split = [batch_size] + [n for d in range(1, len(self.shape)) for n in (self.sizes[d], self.shape[d])]
            g = g.reshape(split).sum(tuple(range(1, 2 * len(self.shape) - 1, 2))) if len(self.shape) > 1 else g
        else:
            dims = tuple(d for d in range(1, len(self.shape)) if self.shape[d] == 1 and g.shape[d] != 1)
            g = g.sum(dims, keepdim=True) if dims else g
        return g.reshape(batch_size, *self.source.shape)


def _sizes(rest: tuple, kwargs: dict, name: str) -> tuple[int, ...] | None:
    value = rest if rest else kwargs.get(name)
    if value is None:
        return None
    if len(value) == 1 and isinstance(value[0], tuple | list | torch.Size):
        value = value[0]
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        return None


def _copy_sizes(func, src: Tensor, args: tuple, kwargs: dict) -> tuple[str, tuple[int, ...]] | None:
    """``(kind, sizes)`` of a copy function's call (the repeat factors aligned to the result's dimensions, or the
    expanded shape), or ``None`` for a call that is no copy along dimension 0 of the kind handled here."""
    rest = args[1:]
    if func in _REPEATS:
        sizes = _sizes(rest, kwargs, _REPEATS[func])
        if sizes is not None and func is not torch.Tensor.repeat and len(sizes) < src.dim():  # tile pads on the left
            sizes = (1,) * (src.dim() - len(sizes)) + sizes
        return None if sizes is None else ("repeat", sizes)
    if func in _EXPANDS:
        sizes = _sizes(rest, kwargs, _EXPANDS[func])
        return None if sizes is None else ("expand", sizes)
    if func is torch.Tensor.expand_as:
        other = rest[0] if rest else kwargs.get("other")
        return ("expand", tuple(other.shape)) if isinstance(other, Tensor) else None
    repeats = rest[0] if rest else kwargs.get("repeats")
    dim = rest[1] if len(rest) > 1 else kwargs.get("dim")
    if not isinstance(repeats, int) or src.dim() == 0 or dim not in (0, -src.dim()):
        return None
    return "repeat", (repeats,) + (1,) * (src.dim() - 1)


def batch_copy(func, args: tuple, kwargs: dict, out, batch_size: int) -> BatchCopy | None:
    """The copy along the batch that this call of a :data:`COPY_FUNCTIONS` function made, if it made one: a
    floating-point source that requires grad, with a new or size-1 dimension 0 copied to ``k * batch_size`` rows."""
    src = args[0] if args else kwargs.get("input")
    if not isinstance(src, Tensor) or not src.requires_grad or not src.is_floating_point():
        return None
    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] < batch_size or out.shape[0] % batch_size:
        return None
    parsed = _copy_sizes(func, src, args, kwargs)
    if parsed is None or len(parsed[1]) < src.dim() or len(parsed[1]) != out.dim():
        return None
    kind, sizes = parsed
    shape = (1,) * (len(sizes) - src.dim()) + tuple(src.shape)
    if shape[0] != 1:
        return None
    if kind == "expand":
        sizes = tuple(n if s == -1 else s for s, n in zip(sizes, shape, strict=True))
        expected = sizes
    else:
        expected = tuple(s * n for s, n in zip(sizes, shape, strict=True))
    return BatchCopy(src, kind, shape, sizes) if expected == tuple(out.shape) else None


class _CopyWatcher(TorchFunctionMode):
    """Calls ``on_copy(func, args, kwargs, out)`` for every call of a :data:`COPY_FUNCTIONS` function, unless
    ``paused`` (the engine's own expansions)."""

    def __init__(self, on_copy) -> None:
        super().__init__()
        self.on_copy = on_copy
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in COPY_FUNCTIONS and not self.paused:
            self.on_copy(func, args, kwargs, out)
        return out


class CopyTaint(TorchFunctionMode):
    """Whether a run copies along the batch (a :data:`COPY_FUNCTIONS` call: :attr:`copied`) a tensor computed from
    the tensors given to :meth:`taint`. A tensor is tainted if some torch function returned it from a tainted argument
    (top level, or in a top-level list or tuple), with a view's base. The proof expands the ``[1, ...]`` outputs to
    the batch first and keeps that only if no expanded output is also copied (:meth:`~.proof.PlanProof.
    _prove_expansions`); a copy missed here leaves the expansion to the first batch's support check."""

    def __init__(self) -> None:
        super().__init__()
        self._marks: dict[int, weakref.ref] = {}
        self.copied = False

    def reset(self) -> None:
        """Forget the marks and copies of an earlier run."""
        self._marks, self.copied = {}, False

    def taint(self, tensors) -> None:
        for t in tensors:
            self._mark(t)

    def _mark(self, t: Tensor) -> None:
        self._marks[id(t)] = weakref.ref(t)
        base = t._base
        if base is not None:
            self._marks[id(base)] = weakref.ref(base)

    def _has(self, t: Tensor) -> bool:
        marks = self._marks
        ref = marks.get(id(t))
        if ref is not None and ref() is t:
            return True
        base = t._base
        ref = marks.get(id(base)) if base is not None else None
        return ref is not None and ref() is base

    def _any_tainted(self, args: tuple) -> bool:
        """Whether some tensor of ``args`` (top level, or in a top-level list or tuple) is tainted."""
        for x in args:
            if isinstance(x, Tensor):
                if self._has(x):
                    return True
            elif isinstance(x, list | tuple):
                for y in x:
                    if isinstance(y, Tensor) and self._has(y):
                        return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self._any_tainted(args) or (kwargs and self._any_tainted(tuple(kwargs.values()))):
            self.copied = self.copied or func in COPY_FUNCTIONS
            if isinstance(out, Tensor):
                self._mark(out)
            elif isinstance(out, list | tuple):
                for t in out:
                    if isinstance(t, Tensor):
                        self._mark(t)
        return out


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the torch function mode stack wherever it is (modes pushed after it stay, in order)."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for top in reversed(above):
        torch._C._push_on_torch_function_stack(top)


@dataclass(eq=False)
class SharedOutput:
    """One deferred output of one call: the tensor the model got, and its per-copy gradient ``[B, *shape]`` summed
    over the copies seen so far in the backward pass ``task``."""

    use: Use
    tensor: Tensor
    per_copy: Tensor | None = None
    task: int = -1

    def add(self, task: int, grad: Tensor) -> None:
        if self.task != task or self.per_copy is None:
            self.per_copy, self.task = grad, task
        else:
            self.per_copy = self.per_copy + grad

    def take(self, task: int) -> Tensor | None:
        grad = self.per_copy if self.task == task else None
        self.per_copy, self.task = None, -1
        return grad


@dataclass(eq=False)
class SharedState:
    """The deferred outputs of one forward pass, and the mode that watches for copies of them."""

    outputs: list[SharedOutput] = field(default_factory=list)
    watcher: _CopyWatcher | None = None


class SharedOutputs:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: deferred ``[1, ...]`` outputs and the copies of them the
    model makes along the batch."""

    def _shared_tensor(self, leaf: Tensor) -> Tensor:
        """The deferred output the model gets: a tensor of the engine's own (``+ 0`` from a zero scalar that requires
        grad), whose gradient is the caller's alone and which has a graph even without trainable inputs."""
        return leaf + self._origin(leaf)

    def _deferral(self, entry, layout, out_leaves: list, frame, reentrant: bool):
        """The layout to book-keep a call with: a deferred one whose ``[1, ...]`` outputs arrived with the batch's rows
        (an input expanded upstream made them the examples' copies) is read as expanded; a deferred one in a region of
        activation checkpointing is refused."""
        if not layout.deferred:
            return layout
        if any(out_leaves[j].shape[0] != 1 for j in layout.expand):
            return replace(layout, deferred=False)
        if frame is not None or reentrant:
            raise UnsupportedModuleError(
                f"The output of `{entry.name}` ({type(entry.module).__name__}) is computed once for the whole batch "
                "and copied along it, inside a region of activation checkpointing: hf_dp follows such copies in the "
                "forward pass only. Keep that module out of the checkpointed region, or freeze its parameters."
            )
        return layout

    @property
    def _copies_paused(self):
        """While the engine book-keeps a call (its own expansions of broadcast outputs are no copies of the model's)."""
        shared = self._pass.shared if self._pass is not None else None
        return _Paused(shared.watcher if shared is not None else None)

    def _hook_shared(self, use: Use, positions: list[int] | None, tensors: list[Tensor]) -> None:
        """Hook the deferred outputs of ``use`` (all its hooked outputs: its broadcast ones, deferred by the plan), and
        watch the rest of the forward pass for copies of them along the batch."""
        p = self._pass
        if p.shared is None:
            p.shared = SharedState()
        records = [SharedOutput(use, t) for t in tensors]
        p.shared.outputs.extend(records)
        if p.size > 1 and p.shared.watcher is None:
            p.shared.watcher = _CopyWatcher(self._on_copy)
            p.shared.watcher.__enter__()
        hook = functools.partial(self._on_shared_grads, use, positions, records)
        if len(tensors) == 1:
            tensors[0].register_hook(lambda g: hook([g]))
        else:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="all")

    def _stop_copies(self) -> None:
        """The forward pass ended: no more copies to watch for."""
        shared = self._pass.shared if self._pass is not None else None
        if shared is not None and shared.watcher is not None:
            watcher, shared.watcher = shared.watcher, None
            _remove_mode(watcher)

    def _on_copy(self, func, args: tuple, kwargs: dict, out) -> None:
        p = self._pass
        if p is None or not self._capturing or self._internal or p.shared is None:
            return
        copy = batch_copy(func, args, kwargs, out, p.size)
        if copy is None:
            return
        before = [r for r in p.shared.outputs if r.tensor.requires_grad]
        out.register_hook(functools.partial(self._on_copy_grad, copy, before))

    def _on_copy_grad(self, copy: BatchCopy, outputs: list[SharedOutput], grad: Tensor) -> None:
        """Each example's share of a copy's gradient, carried back to the deferred outputs the copied tensor comes
        from (``dL_i/dy = J_{s,y}^T dL_i/ds``)."""
        p = self._pass
        if p is None or p.phase is None or self._internal:
            return
        task = graph_task_id()
        per_copy = copy.per_copy(grad, p.size)
        with self._inert():
            grads = _through(copy.source, [r.tensor for r in outputs], per_copy)
        for record, g in zip(outputs, grads, strict=True):
            if g is not None:
                record.add(task, g)

    def _on_shared_grads(self, use: Use, positions: list[int] | None, records: list[SharedOutput], grads) -> None:
        """The output hook of a call with deferred outputs: each one's gradient autograd brings, replaced by its
        per-copy gradients (``[B, ...]``, as if the output had been expanded to the batch) once checked against it."""
        p = self._pass
        if p is None or p.phase is None or self._internal:
            return
        grads = [g if g is None else self._copies_grad(r, g) for r, g in zip(records, grads, strict=True)]
        if positions is None:
            self._on_grad(use, grads[0])
        else:
            self._on_output_grads(use, positions, grads)

    def _copies_grad(self, record: SharedOutput, total: Tensor) -> Tensor:
        """``[B, ...]``: the per-copy gradients of a deferred ``[1, ...]`` output, which must add up to ``total``."""
        b = self._pass.size
        per_copy = record.take(graph_task_id())
        if b == 1:
            return total  # the one example's gradient
        if per_copy is None:
            per_copy = total.new_zeros((b, *total.shape))
        if total.numel() == 0:
            return per_copy.reshape(b * total.shape[0], *total.shape[1:])
        # entries that are not finite say nothing (an example whose activations overflowed gets weight 0 anyway)
        diff, size = (per_copy.sum(0) - total).abs(), torch.maximum(per_copy.abs().sum(0), total.abs())
        finite = torch.isfinite(diff) & torch.isfinite(size)
        zero = torch.zeros((), dtype=diff.dtype, device=diff.device)
        worst, scale = torch.stack(
            [torch.where(finite, diff, zero).max(), torch.where(finite, size, zero).max()]
        ).tolist()
        if worst > tolerance(total.dtype) * max(scale, 1e-30):
            entry = record.use.entry
            raise UnsupportedModuleError(
                f"The output of `{entry.name}` ({type(entry.module).__name__}) is computed once for the whole batch, "
                "and reaches the loss otherwise than through copies of it along the batch (`repeat`, `expand`, "
                "`expand_as`, `broadcast_to`, `tile`, `repeat_interleave` along dimension 0) in the forward pass: "
                f"its per-example gradient cannot be proven (the examples' shares add up to {worst:.3g} less than "
                "the gradient it gets). Compute it per example (its inputs with one row per example), copy it "
                "along the batch explicitly, or freeze its parameters. Nothing of its parameters was added to "
                "`p.grad`."
            )
        return per_copy.reshape(b * total.shape[0], *total.shape[1:])


def copied_calls(model, sub: tuple[tuple, dict], calls: dict[tuple[int, int], tuple[int, ...]]) -> set:
    """The calls, among ``calls`` (``(id(module), ordinal)`` -> positions of its ``[1, ...]`` outputs), whose
    ``[1, ...]`` outputs reach the model's output on the probe's sub-batch of two examples ``sub`` through copies of
    them along the batch alone (:func:`batch_copy`), not also through a broadcast (HF position embeddings added to
    the batch): those the plan defers. One forward and backward pass with gradients, in the probe's mode: the
    outputs' gradients (of a random projection of the model's output) against the sums of their copies'."""
    modules, outputs, copies = {}, [], []
    origin = torch.zeros((), requires_grad=True)

    def output_hook(record, output):
        positions = calls.get((id(record.module), record.ordinal))
        if not positions:
            return None
        leaves, spec = tree_flatten(output)
        for j in positions:
            leaves[j] = leaves[j] + origin.to(leaves[j].dtype)
            outputs.append(((id(record.module), record.ordinal), leaves[j]))
        return tree_unflatten(leaves, spec)

    def on_copy(func, args, kwargs, out):
        copy = batch_copy(func, args, kwargs, out, 2)
        if copy is not None:
            copies.append((copy, out, len(outputs)))

    for module in model.modules():
        if any(id(module) == key for key, _ in calls):
            modules[id(module)] = module
    try:
        with _CopyWatcher(on_copy):
            out = run_expanded(model, *sub, list(modules.values()), output_hook, in_eval_mode=True, with_grad=True)
        ends = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point()]
        if not ends or not outputs or not copies:
            return set()
        total = sum((t * torch.randn_like(t)).sum() for t in ends)
        tensors = [t for _, t in outputs]
        grads = torch.autograd.grad(total, tensors + [z for _, z, _ in copies], retain_graph=True, allow_unused=True)
        shares: list = [None] * len(tensors)
        for (copy, _, before), g in zip(copies, grads[len(tensors) :], strict=True):
            if g is not None:
                got = _through(copy.source, tensors[:before], copy.per_copy(g, 2))
                shares[:before] = [
                    s if x is None else (x.sum(0) if s is None else s + x.sum(0))
                    for s, x in zip(shares, got, strict=True)
                ]
    except Exception:  # noqa: BLE001  (the model cannot run with gradients here: nothing proven, defer nothing)
        return set()
    copied, refused = set(), set()
    for (key, _), g, share in zip(outputs, grads[: len(tensors)], shares, strict=True):
        if share is None or (g is not None and not _same(share, g)):
            refused.add(key)
        else:
            copied.add(key)
    return copied - refused


def _same(a: Tensor, b: Tensor) -> bool:
    scale = float(torch.maximum(a.abs().max(), b.abs().max())) if a.numel() else 0.0
    return a.numel() == 0 or float((a - b).abs().max()) <= tolerance(b.dtype) * max(scale, 1e-30)


class _Paused:
    def __init__(self, watcher: _CopyWatcher | None) -> None:
        self.watcher = watcher

    def __enter__(self) -> None:
        if self.watcher is not None:
            self.watcher.paused += 1

    def __exit__(self, *exc) -> None:
        if self.watcher is not None:
            self.watcher.paused -= 1


def _through(source: Tensor, targets: list[Tensor], per_copy: Tensor) -> list[Tensor | None]:
    """``J_{source,t}^T per_copy[i]`` for every target ``t`` and copy ``i`` (``[B, *t.shape]``; ``None`` for a
    target ``source`` does not depend on): one batched ``autograd.grad``, or a loop where a backward op has no
    batching rule."""
    if not targets:
        return []
    if len(targets) == 1 and targets[0] is source:
        return [per_copy]
    try:
        return list(
            torch.autograd.grad(source, targets, per_copy, retain_graph=True, allow_unused=True, is_grads_batched=True)
        )
    except RuntimeError:
        rows = [
            torch.autograd.grad(source, targets, g, retain_graph=True, allow_unused=True) for g in per_copy.unbind(0)
        ]
        return [None if parts[0] is None else torch.stack(parts) for parts in zip(*rows, strict=True)]
