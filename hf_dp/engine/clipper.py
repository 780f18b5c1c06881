"""``BookKeepingClipper``: per-example clipping in one backward pass (Bu et al. 2023, book-keeping).

Life of one micro-batch:

1. forward: the root pre-hook switches ``requires_grad`` off on the trainable parameters (ghost differentiation:
   autograd never computes their non-private gradients) and back on in the post-hook, once the graph is built; each
   hooked module keeps its inputs (book-keeping, detached references) and registers a hook on its outputs. On the
   first forward after a (re)plan the engine first proves the plan on sub-batches (:mod:`.probe`, :mod:`.planner`)
   and then verifies it on the real forward (:mod:`.verify`).
2. ``prepare(loss)``: the loss must be ``[B]``; on the first batch of a plan, the engine checks that loss ``j``
   depends on the rows of example ``j`` alone in every hooked output (two extra backward passes, once).
3. backward: each output hook receives the output gradient ``g`` and adds its layers' per-example squared norms
   (ghost norm, or instantiation where BK-MixOpt prefers it).
4. ``finish()`` (never inside a hook): parameters used more than once get their exact cross terms, total norms give
   ``c_i = min(1, C / (||g_i|| + 1e-6))``, and ``p.grad += sum_i c_i g_i`` is formed from the book-kept factors under
   ``no_grad`` (``p.grad`` never carries a graph).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layers import Captured, Layout, UnsupportedModuleError
from ..layers.base import autocast_state
from ..layers.grads import FactoredGrad, PerExampleGrad, compute_dtype, inner, instantiate, merge, norm_sq, weighted_sum
from .batch import RootBatch, root_batch, slice_batch
from .coverage import HookedModule, plan_coverage, trainable_parameters
from .planner import CallLayout, Plan, build_plan, expansion_changes_output, needs_third_run
from .probe import eval_mode, frozen_rng, run_probe
from .rows import closed_form_grads, foreign_rows, grad_layout
from .self_check import self_check
from .verify import Verification

logger = logging.getLogger(__name__)

__all__ = ["CLIPPING_MODES", "BookKeepingClipper"]

#: Clipping modes and what they do.
CLIPPING_MODES: dict[str, str] = {
    "bk": "ghost norm for every sequence layer, clipped sum from the book-kept factors (one backward)",
    "bk-mixopt": "per layer: ghost norm when 2T^2 < p*d, else instantiate the per-example gradient (one backward)",
    "per-sample": "instantiate every per-example gradient (Opacus-style, one backward)",
    "ghost": "GhostClip baseline: ghost norms from a first backward, then a second backward of the reweighted loss",
}


class _ModelHook:
    """A hook the engine puts on the user's model. A deep copy or a pickle of the model gets an inert one, so that
    ``copy.deepcopy(model)`` and ``torch.save(model)`` work while the clipper is installed (the copy is plain)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable | None = None) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return None if self.fn is None else self.fn(*args, **kwargs)

    def __deepcopy__(self, memo) -> _ModelHook:
        return _ModelHook()

    def __reduce__(self):
        return (_ModelHook, ())


@dataclass(eq=False)
class _Use:
    """One call of a hooked module in the current forward pass."""

    entry: HookedModule
    params: list[nn.Parameter]
    captured: Captured | None
    layout: CallLayout
    grads: dict[nn.Parameter, PerExampleGrad] = field(default_factory=dict)


@dataclass(eq=False)
class _Pass:
    """State of one forward/backward pass."""

    batch: RootBatch
    ghost_diff: bool
    keep_all: bool = False  # keep every per-use gradient (the self-check's per-parameter norms)
    ordinal: dict[int, int] = field(default_factory=dict)  # module -> ordinal of its current call
    counts: dict[int, int] = field(default_factory=dict)
    uses: list[_Use] = field(default_factory=list)
    phase: str | None = None  # None, "record" (our backward), "support" (the first-batch layout check)
    support_example: int = 0
    support_failures: list[str] = field(default_factory=list)
    norm_sq: Tensor | None = None
    use_counts: dict[nn.Parameter, int] = field(default_factory=dict)
    grad_events: int = 0
    grads_before: dict | None = None  # ghost mode: p.grad before the first backward; bk: (id, version) of p.grad
    complete: bool = False  # the forward pass returned

    @property
    def size(self) -> int:
        return self.batch.size


class BookKeepingClipper:
    """Per-example gradient clipping for any ``nn.Module``, by book-keeping, in one backward pass.

    Args:
        model (`nn.Module`): the model; every parameter with ``requires_grad`` is clipped per example. Its tensor
            inputs carry the examples along dimension 0.
        max_grad_norm (`float`): the clipping norm ``C`` (for a loss scaled by ``K``, pass ``K * C``).
        mode (`str`, *optional*, defaults to `"bk-mixopt"`): one of :data:`CLIPPING_MODES`.
        allow_fallback (`bool`, *optional*, defaults to `True`): use the torch.func rule for modules with trainable
            parameters and no closed-form rule, and for parameters used where no rule sees them; if `False`, such
            modules raise ``UnsupportedModuleError``.

    Raises:
        UnsupportedModuleError: BatchNorm anywhere in the model, or a trainable parameter no rule covers (at
            construction); a parameter, layer or layout the engine cannot make exact (at the first forward pass, with
            what to change).
        ValueError: an unknown mode or a non-positive clipping norm.

    Example:
        ```python
        clipper = BookKeepingClipper(model, max_grad_norm=0.1)
        loss = per_example_loss(model(**batch), batch)  # [B]
        clipper.backward(loss)  # p.grad += sum_i min(1, C / ||g_i||) g_i
        clipper.per_example_norms  # [B]
        clipper.remove()
        ```
    """

    def __init__(
        self, model: nn.Module, *, max_grad_norm: float, mode: str = "bk-mixopt", allow_fallback: bool = True
    ) -> None:
        if mode not in CLIPPING_MODES:
            raise ValueError(f"Unknown clipping mode {mode!r}. Choose one of {sorted(CLIPPING_MODES)}.")
        if not max_grad_norm > 0:
            raise ValueError(f"`max_grad_norm` must be > 0, got {max_grad_norm}.")
        self.model = model
        self.max_grad_norm = float(max_grad_norm)
        self.mode = mode
        self.allow_fallback = allow_fallback
        self.per_example_norms: Tensor | None = None
        self._original_requires_grad = {p: p.requires_grad for p in model.parameters()}
        self._static = plan_coverage(model, allow_fallback=allow_fallback)
        self._trainable = tuple(trainable_parameters(model))
        # the modules that can turn gradient checkpointing on (transformers sets this attribute), checked per forward
        self._checkpointable = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self._plan: Plan | None = None
        self._plan_handles: list = []
        self._verification: Verification | None = None
        self._verified: bool | None = None  # model.training of the last verified forward (None: not yet)
        self._support_checked = False
        self._sum_checked = False  # ghost mode: engine sums vs autograd, once per plan
        self._pass: _Pass | None = None
        self._prepared = False
        self._capturing = False
        self._internal = 0  # > 0 while the engine runs the model or a rule itself: every hook stands aside
        self._force_ghost_diff = False
        self._shadow_depth: dict[nn.Parameter, int] = defaultdict(int)
        self._shadow_start: dict[int, list[nn.Parameter]] = {}
        self._origins: dict[tuple, Tensor] = {}
        self._norm_dtype = self._compute_norm_dtype()
        self._root_handles = [
            model.register_forward_pre_hook(_ModelHook(self._on_root_start), with_kwargs=True, prepend=True),
            model.register_forward_hook(_ModelHook(self._on_root_end), always_call=True),
        ]

    # ------------------------------------------------------------------ public helpers
    @property
    def hooked_modules(self) -> list[tuple[str, str]]:
        """``(module name, rule name)`` for every module the engine hooks (the proven plan once a batch was seen)."""
        entries = self._plan.hooked if self._plan is not None else self._static
        return [(h.name, type(h.rule).__name__) for h in entries]

    def remove(self) -> None:
        """Remove every hook and restore the parameters' ``requires_grad``: the model is a plain model again."""
        self._end_capture()
        for handle in self._root_handles + self._plan_handles:
            handle.remove()
        self._root_handles, self._plan_handles = [], []
        for p, flag in self._original_requires_grad.items():
            p.requires_grad_(flag)
        self._plan, self._pass, self._prepared, self._capturing = None, None, False, False
        self._origins = {}
        self._shadow_depth = defaultdict(int)

    def self_check(
        self,
        inputs: dict,
        per_example_loss: Callable[[nn.Module, dict], Tensor],
        *,
        num_examples: int = 3,
    ) -> float:
        """Compare the engine's per-example gradient norms with plain per-example autograd on a real micro-batch.

        In eval mode (training flags restored afterwards) and without changing the random number streams, the engine
        computes per-parameter per-example norms of ``per_example_loss(model, inputs)`` in a norms-only pass (no
        ``p.grad``, no clipper state touched); then each of the first ``num_examples`` examples runs alone (every
        batch tensor of ``inputs`` sliced to ``[i:i+1]``) through an ordinary backward pass with the clipper's hooks
        standing aside. Tolerances are relative to the example's total norm: float64 1e-6, float32 1e-3,
        bfloat16/float16 5e-2 (``hf_dp.engine.self_check.SELF_CHECK_TOLERANCE``).

        Args:
            inputs (`dict`): a micro-batch, as ``per_example_loss`` takes it.
            per_example_loss (`Callable[[nn.Module, dict], torch.Tensor]`): ``(model, inputs) -> [B]``, e.g. calling
                ``model(**inputs)``.
            num_examples (`int`, *optional*, defaults to 3): how many examples to compare.

        Returns:
            `float`: the largest relative error found.

        Raises:
            SelfCheckError: naming the parameters whose per-example norms differ.

        Example:
            ```python
            clipper.self_check(batch, lambda m, b: causal_lm_loss(m(**b).logits, b["labels"]))
            ```
        """
        return self_check(self, inputs, per_example_loss, num_examples=num_examples)

    # ------------------------------------------------------------------ plan
    def _compute_norm_dtype(self) -> torch.dtype:
        dtype = torch.float32
        for p in self._trainable:
            dtype = torch.promote_types(dtype, compute_dtype(p.dtype))
        return dtype

    @contextlib.contextmanager
    def _inert(self):
        """Every hook of the engine stands aside (the engine runs the model, a rule or the self-check itself)."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    def _names(self) -> tuple[dict[int, str], dict[nn.Parameter, str]]:
        modules = {}
        for name, module in self.model.named_modules():
            modules.setdefault(id(module), name)
        params = {}
        for name, p in self.model.named_parameters():
            params.setdefault(p, name)
        return modules, params

    def _replan_if_changed(self) -> bool:
        current = trainable_parameters(self.model)
        if [id(p) for p in current] == [id(p) for p in self._trainable]:
            return False
        # requires_grad changed: check coverage again, and prove a new plan on the next batch
        self._static = plan_coverage(self.model, allow_fallback=self.allow_fallback)
        self._trainable = tuple(current)
        self._norm_dtype = self._compute_norm_dtype()
        self._uninstall()
        return True

    def _uninstall(self) -> None:
        for handle in self._plan_handles:
            handle.remove()
        self._plan_handles, self._plan = [], None
        self._verified, self._support_checked, self._sum_checked = None, False, False

    def _make_plan(self, args: tuple, kwargs: dict, batch: RootBatch) -> Plan:
        names, param_names = self._names()
        params = {id(p): p for p in self._trainable}
        devices = sorted({p.device for p in self.model.parameters()}, key=str)
        with self._inert(), frozen_rng(devices):
            try:
                one = run_probe(self.model, *slice_batch(args, kwargs, batch, [0]), params)
                pair = [1, 0] if batch.size > 1 else [0, 0]
                two = run_probe(self.model, *slice_batch(args, kwargs, batch, pair), params)
                three = None
                if needs_third_run(one, two):  # e.g. a mask built only when some example is padded
                    triple = [1, 1, 0] if batch.size > 1 else [0, 0, 0]
                    three = run_probe(self.model, *slice_batch(args, kwargs, batch, triple), params)
            except UnsupportedModuleError:
                raise
            except Exception as err:
                raise UnsupportedModuleError(
                    "hf_dp proves where the examples lie in every layer by running the model on sub-batches of 1 "
                    f"and 2 examples cut out of this batch (dimension 0 of every input of size {batch.size}), and "
                    f"that run failed: {type(err).__name__}: {err}. Pass batch-first inputs whose examples can be "
                    "sliced along dimension 0."
                ) from err
            with eval_mode(self.model):
                plan = build_plan(
                    self._static, one, two, names, param_names, allow_fallback=self.allow_fallback, three=three
                )
            expand = {}
            by_id = {id(e): e for e in plan.hooked}
            for (entry_id, ordinal), layout in plan.calls.items():
                if layout.expand:
                    expand[(id(by_id[entry_id].module), ordinal)] = layout.expand
            if expand:
                try:
                    expanded = run_probe(
                        self.model,
                        *slice_batch(args, kwargs, batch, pair),
                        params,
                        output_hook=functools.partial(_expand_output, expand, 2),
                    )
                    changed = expansion_changes_output(two.output, expanded.output)
                except Exception:  # noqa: BLE001  (the model cannot take the expanded tensor)
                    changed = True
                if changed:
                    which = sorted({by_id[e].name for (e, _), lay in plan.calls.items() if lay.expand})
                    raise UnsupportedModuleError(
                        f"The outputs of {which} are the same for every example ([1, ...], e.g. position ids built "
                        "with batch size 1); hf_dp expands them to the batch to get their per-example gradients, but "
                        "the model does not use them as a broadcast over the examples (e.g. it runs on several rows "
                        "per example). Pass such inputs (e.g. `position_ids`) with one row per row of the model's "
                        "batch, or freeze their parameters."
                    )
        return plan

    def _install(self, plan: Plan) -> None:
        for handle in self._plan_handles:
            handle.remove()
        self._plan_handles = []
        modules: dict[int, nn.Module] = {}
        for entry in plan.hooked:
            modules[id(entry.module)] = entry.module
            hook = _ModelHook(functools.partial(self._on_forward, entry))
            self._plan_handles.append(
                entry.module.register_forward_hook(hook, with_kwargs=True, prepend=True, always_call=True)
            )
        for module in modules.values():
            if module is not self.model:  # the root's own start is handled by the root pre-hook
                self._plan_handles.append(module.register_forward_pre_hook(_ModelHook(self._on_module_start)))
        self._shadow_start = {}
        for entry in plan.hooked:
            self._shadow_start.setdefault(id(entry.module), []).extend(plan.shadowing.get(id(entry), ()))
        self._plan = plan

    # ------------------------------------------------------------------ forward
    def _ghost_differentiation(self) -> bool:
        return self._force_ghost_diff or self.mode != "ghost"

    def _on_root_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._internal:
            return None
        if self._capturing:  # the previous forward pass raised and never reached the root's post-hook
            self._end_capture()
            self._pass = None
        if self._prepared:
            logger.warning(
                "hf_dp: a forward pass started between `prepare()` and `finish()`; the prepared micro-batch is "
                "dropped (its `finish()` will raise)."
            )
            self._prepared, self._pass = False, None
        self._shadow_depth = defaultdict(int)
        if not torch.is_grad_enabled():
            return None
        if self._replan_if_changed():
            self._pass = None
        if self.model.training and any(m.gradient_checkpointing is True for m in self._checkpointable):
            raise UnsupportedModuleError(
                "Gradient checkpointing is on: it recomputes parts of the forward pass inside the backward pass, where "
                "book-keeping cannot follow them. Call `model.gradient_checkpointing_disable()` (or set "
                "`gradient_checkpointing=False`)."
            )
        batch = root_batch(self.model, args, kwargs)
        if batch.size > 0 and self._plan is None:
            self._install(self._make_plan(args, kwargs, batch))
            self._pass = None
        ghost_diff = self._ghost_differentiation()
        p = self._pass
        if p is None or p.size != batch.size or p.ghost_diff != ghost_diff:
            if p is not None and p.uses:
                logger.warning(
                    "hf_dp: a forward pass of %d examples follows one of %d that no `prepare()` consumed; only the "
                    "new one is book-kept.",
                    batch.size,
                    p.size,
                )
            # Several forward passes before one `prepare()` (pairs of inputs through the same model) are book-kept
            # together: each is one more use of every parameter, with exact cross terms.
            self._pass = _Pass(batch, ghost_diff=ghost_diff)
        self._pass.counts, self._pass.ordinal, self._pass.complete = {}, {}, False
        if self._plan is not None and self._verified != self.model.training and batch.size > 0:
            names, param_names = self._names()
            self._verification = Verification(self.model, self._plan.hooked, list(self._trainable), names, param_names)
            self._verification.start()
        self._on_module_start(module, args)
        self._capturing = True
        if self._pass.ghost_diff:
            for p in self._trainable:
                p.requires_grad_(False)
        return None

    def _on_root_end(self, module: nn.Module, args: tuple, output) -> None:
        if self._internal or not self._capturing:
            return None
        verified = self._verification is not None
        self._end_capture()
        if verified:
            self._verified = self.model.training
        if self._pass is not None:
            self._pass.complete = True
        return None

    def _end_capture(self) -> None:
        """Back to a plain model between forward passes: no verification mode, ``requires_grad`` restored."""
        self._stop_verification()
        if self._capturing and self._pass is not None and self._pass.ghost_diff:
            for p in self._trainable:
                p.requires_grad_(True)
        self._capturing = False

    def _stop_verification(self) -> None:
        if self._verification is not None:
            verification, self._verification = self._verification, None
            verification.stop()

    def _on_module_start(self, module: nn.Module, args: tuple) -> None:
        p = self._pass
        if self._internal or p is None:
            return None
        count = p.counts.get(id(module), 0)
        p.counts[id(module)] = count + 1
        p.ordinal[id(module)] = count
        for q in self._shadow_start.get(id(module), ()):
            self._shadow_depth[q] += 1
        return None

    def _origin(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._origins:
            self._origins[key] = torch.zeros((), device=like.device, dtype=like.dtype, requires_grad=True)
        return self._origins[key]

    def _on_forward(self, entry: HookedModule, module: nn.Module, args: tuple, kwargs: dict, output):
        plan, p = self._plan, self._pass
        if self._internal or p is None or plan is None or not self._capturing:
            return None
        shadowing = plan.shadowing.get(id(entry), ())
        params = entry.params
        shadowed = plan.shadowed.get(id(entry))
        if shadowed:
            skip = {q for q in shadowed if self._shadow_depth[q] - (q in shadowing) > 0}
            if skip:
                params = [q for q in params if q not in skip]
        for q in shadowing:
            self._shadow_depth[q] -= 1
        if not params or p.size == 0 or output is None:
            return None
        ordinal = p.ordinal.get(id(module), 0)
        layout = plan.calls.get((id(entry), ordinal))
        if layout is None:
            raise UnsupportedModuleError(
                f"Call {ordinal} of module `{entry.name}` ({type(module).__name__}) in this forward pass was not seen "
                "(or could not be read per example) when hf_dp proved the layouts on the first batch, in eval mode: "
                "the model takes another path now. Keep the forward pass the same in train and eval mode, or freeze "
                f"the parameters of `{entry.name}`."
            )
        if entry.is_fallback:
            return self._capture_fallback(entry, params, module, args, kwargs, output, layout)
        return self._capture_closed_form(entry, params, module, args, kwargs, output, layout)

    def _rows_error(self, entry: HookedModule, what: str, err: ValueError) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            f"The {what} of module `{entry.name}` ({type(entry.module).__name__}) no longer has the layout proven on "
            f"the first batch ({err}); the model changed the way it arranges examples between batches."
        )

    def _capture_closed_form(self, entry, params, module, args, kwargs, output, layout: CallLayout):
        b = self._pass.size
        out_layout: Layout = layout.outputs[0]
        if not isinstance(output, Tensor):
            raise UnsupportedModuleError(
                f"Module `{entry.name}` ({type(module).__name__}) returned {type(output).__name__} instead of the "
                "tensor it returned on the first batch."
            )
        try:
            out_layout.rows(output, b)
        except ValueError as err:
            raise self._rows_error(entry, "output", err) from err
        captured = entry.rule.capture(module, args, kwargs, output)
        captured.args = tuple(x.detach() if isinstance(x, Tensor) else x for x in captured.args)
        new_output = None
        if out_layout.broadcast:
            output = new_output = output.expand(b, *output.shape[1:])
        if not output.requires_grad:
            # Ghost differentiation leaves this output without a graph (its inputs need no gradient and its
            # parameters are switched off); a zero scalar that requires grad gives it one at ~no cost.
            output = new_output = output + self._origin(output)
        use = _Use(entry, params, captured, layout)
        self._pass.uses.append(use)
        output.register_hook(functools.partial(self._on_output_grad, use, None))
        return new_output

    def _capture_fallback(self, entry, params, module, args, kwargs, output, layout: CallLayout):
        b = self._pass.size
        leaves, spec = tree_flatten(output)
        if len(leaves) != len(layout.outputs):
            raise UnsupportedModuleError(
                f"Module `{entry.name}` ({type(module).__name__}) returned {len(leaves)} values instead of the "
                f"{len(layout.outputs)} it returned on the first batch."
            )
        in_leaves, in_spec = tree_flatten((tuple(args), dict(kwargs)))
        for leaf, lay in zip(in_leaves, layout.inputs or [], strict=False):
            if lay is not None and isinstance(leaf, Tensor):
                try:
                    lay.rows(leaf, b)
                except ValueError as err:
                    raise self._rows_error(entry, "input", err) from err
        positions, tensors, changed = [], [], False
        for j, (leaf, lay) in enumerate(zip(leaves, layout.outputs, strict=True)):
            if lay is None:
                continue
            if not isinstance(leaf, Tensor):
                raise UnsupportedModuleError(f"Output {j} of module `{entry.name}` is no longer a tensor.")
            try:
                lay.rows(leaf, b)
            except ValueError as err:
                raise self._rows_error(entry, "output", err) from err
            if lay.broadcast:
                leaf, changed = leaf.expand(b, *leaf.shape[1:]), True
            if not leaf.requires_grad:
                leaf, changed = leaf + self._origin(leaf), True
            leaves[j] = leaf
            positions.append(j)
            tensors.append(leaf)
        out_layouts = [None if lay is None else grad_layout(lay) for lay in layout.outputs]
        in_leaves = [None if i in layout.drop else x for i, x in enumerate(in_leaves)]  # caches: proven empty here
        detached = tree_unflatten([x.detach() if isinstance(x, Tensor) else x for x in in_leaves], in_spec)
        captured = Captured(
            args=detached[0],
            kwargs=detached[1],
            layouts=(layout.inputs, out_layouts),
            batch_size=b,
            autocast=autocast_state(),
        )
        use = _Use(entry, params, captured, layout)
        self._pass.uses.append(use)
        if len(tensors) == 1:
            tensors[0].register_hook(functools.partial(self._on_output_grad, use, positions))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._on_output_grads, use, positions), mode="all"
            )
        return tree_unflatten(leaves, spec) if changed else None

    # ------------------------------------------------------------------ backward
    def _on_output_grads(self, use: _Use, positions: list[int], grads) -> None:
        full = [None] * len(use.layout.outputs)
        for j, g in zip(positions, grads, strict=True):
            full[j] = g
        self._on_grad(use, full)

    def _on_output_grad(self, use: _Use, positions: list[int] | None, grad: Tensor) -> None:
        if positions is None:
            self._on_grad(use, grad)
        else:
            full = [None] * len(use.layout.outputs)
            full[positions[0]] = grad
            self._on_grad(use, full)

    def _on_grad(self, use: _Use, grad) -> None:
        p = self._pass
        if p is None or p.phase is None or use.captured is None:
            return
        if p.phase == "support":
            self._check_support(use, grad)
            return
        p.grad_events += 1
        use.grads = self._per_example_grads(use, grad)
        for q, g in use.grads.items():
            if p.use_counts.get(q, 0) == 1 and not p.keep_all:
                p.norm_sq += norm_sq(g, self._norm_dtype)
        use.captured = None  # the factors keep what the clipped sum needs; drop the rest
        if self.mode == "ghost" and not p.keep_all:  # norms only: the second backward forms the sum
            use.grads = {q: g for q, g in use.grads.items() if p.use_counts.get(q, 0) > 1}

    def _per_example_grads(self, use: _Use, grad) -> dict[nn.Parameter, PerExampleGrad]:
        entry, b = use.entry, self._pass.size
        with self._inert(), torch.no_grad():
            if entry.is_fallback:
                grads = entry.rule.per_example_grads(entry.module, use.captured, grad, set(use.params))
            else:
                grads = closed_form_grads(
                    entry.rule, entry.module, use.captured, grad, use.layout.outputs[0], b, set(use.params)
                )
        if self.mode in ("bk-mixopt", "per-sample"):
            for q, g in grads.items():
                if isinstance(g, FactoredGrad) and (self.mode == "per-sample" or g.prefers_instantiation()):
                    grads[q] = instantiate(g, g.left.dtype if isinstance(g.left, Tensor) else g.right.dtype)
        return grads

    def _check_support(self, use: _Use, grad) -> None:
        p = self._pass
        grads = grad if isinstance(grad, list) else [grad]
        layouts = use.layout.outputs
        for g, lay in zip(grads, layouts, strict=False):
            if g is None or lay is None:
                continue
            if foreign_rows(g, lay, p.size, p.support_example):
                p.support_failures.append(use.entry.name)
                return

    def _support_check(self, loss: Tensor) -> None:
        """Loss ``j`` must depend on example ``j``'s rows alone in every hooked output (checked for the first and
        the last example, once per plan): a loss that couples examples, or root inputs that are not batch-first,
        fail here instead of giving wrong norms."""
        p = self._pass
        if p.size < 2 or not loss.requires_grad or not p.uses:
            return
        inputs = list(self._origins.values()) + [q for q in self._trainable if q.requires_grad]
        p.phase = "support"
        try:
            for j in sorted({0, p.size - 1}):
                p.support_example = j
                torch.autograd.grad(loss[j], inputs, allow_unused=True, retain_graph=True)
        finally:
            p.phase = None
            for origin in self._origins.values():
                origin.grad = None
        if p.support_failures:
            modules = sorted(set(p.support_failures))
            raise UnsupportedModuleError(
                f"The per-example loss of one example depends on the rows of other examples in the outputs of "
                f"{modules[:3]}{' ...' if len(modules) > 3 else ''}: either the loss couples examples (a batch mean "
                "or normalisation: compute one loss per example), or the model's inputs do not carry the examples "
                "along dimension 0 (e.g. [T, B, ...]: pass batch-first inputs)."
            )

    def backward(self, per_example_loss: Tensor) -> Tensor:
        """Accumulate ``sum_i min(1, C / (||g_i|| + 1e-6)) g_i`` into ``p.grad`` of every trainable parameter.

        One ``per_example_loss.sum().backward()`` (two in ``"ghost"`` mode), then the clipped sum.

        Args:
            per_example_loss (`torch.Tensor`): shape ``[B]``; entry ``i`` must depend on example ``i`` alone.

        Returns:
            `torch.Tensor`: the ``[B]`` clipping coefficients (0 for an example whose gradient is not finite).

        Raises:
            ValueError: a loss that is not ``[B]`` for the batch of the last forward pass, or no forward pass.
            UnsupportedModuleError: a loss that couples examples (checked on the first batch).
        """
        self.prepare(per_example_loss)
        if self._pass.size > 0 and self._pass.uses:
            try:
                per_example_loss.sum().backward(retain_graph=self.mode == "ghost")
            except BaseException:
                self._prepared, self._pass = False, None
                raise
        return self.finish(per_example_loss if self.mode == "ghost" else None)

    def prepare(self, per_example_loss: Tensor) -> None:
        """Start book-keeping the backward pass of ``per_example_loss`` that the caller is about to run.

        For callers that run the backward themselves (the Trainer, through accelerate's loss scaling): call
        ``prepare(loss)``, then any backward of ``w * loss.sum()`` (``w`` a positive constant, e.g. a loss scale), then
        ``finish(loss_scale=w)``; ``p.grad`` then receives ``w * sum_i clip_C(g_i)``.

        Raises:
            ValueError: no forward pass with gradients since the last ``finish()``, or a loss that is not ``[B]``.
            UnsupportedModuleError: a loss that couples examples (checked on the first batch).
        """
        self._begin(per_example_loss, keep_all=False)

    def _begin(self, per_example_loss: Tensor, *, keep_all: bool) -> None:
        if per_example_loss.dim() != 1:
            raise ValueError(
                f"`per_example_loss` must have shape [B] (one loss per example), got {tuple(per_example_loss.shape)}. "
                "A batch-mean loss couples examples and voids the DP bound."
            )
        if self._prepared:
            raise ValueError("`prepare()` was called twice; call `finish()` after each backward pass.")
        p = self._pass
        if p is None or not p.complete:
            raise ValueError(
                "`prepare()` needs a forward pass of the model with gradients enabled since the last `finish()` "
                "(the loss must come from that forward pass)."
            )
        if per_example_loss.shape[0] != p.size:
            raise ValueError(
                f"`per_example_loss` has {per_example_loss.shape[0]} entries but the model's forward pass had "
                f"{p.size} examples (dimension 0 of its inputs): hf_dp needs one loss per example, with the examples "
                "along dimension 0 of every input."
            )
        if self.mode == "ghost" and p.size > 0 and not per_example_loss.requires_grad:
            raise ValueError("`per_example_loss` does not require grad.")
        p.keep_all = keep_all or (self.mode == "ghost" and not self._sum_checked)
        counts: dict[nn.Parameter, int] = defaultdict(int)
        for use in p.uses:
            for q in use.params:
                counts[q] += 1
        p.use_counts = counts
        p.norm_sq = torch.zeros(p.size, dtype=self._norm_dtype, device=per_example_loss.device)
        if not self._support_checked and p.size > 1 and p.uses:
            self._support_check(per_example_loss)
            self._support_checked = True
        if not keep_all and p.size > 0:
            if self.mode == "ghost":
                p.grads_before = {q: q.grad for q in self._trainable}
                for q in self._trainable:  # the first backward must not add into the accumulated gradients
                    q.grad = None
            else:
                p.grads_before = {q: _grad_stamp(q) for q in self._trainable}
        p.phase = "record" if p.size > 0 else None
        self._prepared = True

    def finish(self, per_example_loss: Tensor | None = None, *, loss_scale: float = 1.0) -> Tensor:
        """Clip after the backward pass has finished and add the clipped sum to ``p.grad``.

        Args:
            per_example_loss (`torch.Tensor`, *optional*): the same loss again, for ``"ghost"`` mode's second backward.
            loss_scale (`float`, *optional*, defaults to 1): ``w`` if the backward ran on ``w * loss.sum()``: norms are
                divided by it before clipping (so clipping happens at ``w * C`` in the units of the backward, as in
                Li et al. 2022, App. T, for fp16 loss scaling) and ``p.grad`` receives ``w`` times the clipped sum.

        Returns:
            `torch.Tensor`: the ``[B]`` clipping coefficients.

        Raises:
            ValueError: ``prepare()`` was not called since the last ``finish()``; no hooked module received an output
                gradient (the loss does not depend on the model's forward pass, or the backward did not run); or a
                parameter received a gradient that bypassed the clipper (used outside the model's forward pass).
        """
        if not loss_scale > 0:
            raise ValueError(f"`loss_scale` must be > 0, got {loss_scale}.")
        if not self._prepared:
            raise ValueError(
                "`finish()` without `prepare()`: call `prepare(per_example_loss)` after the forward pass and before "
                "the backward pass of every micro-batch (or use `backward()`)."
            )
        p = self._pass
        self._prepared, self._pass = False, None
        p.phase = None
        for origin in self._origins.values():
            origin.grad = None
        if p.size == 0:
            self.per_example_norms = p.norm_sq
            return p.norm_sq
        if p.uses and p.grad_events == 0:
            raise ValueError(
                "No hooked module received an output gradient in the backward pass: the per-example loss does not "
                "depend on the model's forward pass since `prepare()` (e.g. a `compute_loss` that bypassed the "
                "per-example loss), or the backward pass did not run. Nothing was added to `p.grad`."
            )
        self._check_no_bypass(p)
        grads_by_param: dict[nn.Parameter, list[PerExampleGrad]] = defaultdict(list)
        for use in p.uses:
            for q, g in use.grads.items():
                grads_by_param[q].append(g)
        p.uses = []
        with torch.no_grad():
            pieces = self._shared_norm_sq(p, grads_by_param)
            norms = p.norm_sq.sqrt() / loss_scale
            coef = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            finite = torch.isfinite(norms)
            coef = torch.where(finite, coef, torch.zeros_like(coef))
            keep = None if bool(finite.all()) else finite
            self.per_example_norms = norms.detach()
            if self.mode == "ghost":
                self._check_ghost_sums(p, pieces)
        if self.mode == "ghost":
            if per_example_loss is None:
                raise ValueError("`ghost` mode needs the per-example loss again for its second backward pass.")
            for q in self._trainable:
                q.grad = p.grads_before[q]
            with self._inert():
                (per_example_loss * coef.to(per_example_loss.dtype)).sum().backward()
            for q in self._trainable:
                if q.grad is not None and q.grad.grad_fn is not None:
                    q.grad = q.grad.detach()
            return coef.detach()
        with torch.no_grad():
            for q in list(pieces):
                parts = pieces.pop(q)  # freed as we go: the peak is not "all factors + all gradients"
                total = weighted_sum(parts[0], coef, q.dtype, keep)
                for g in parts[1:]:
                    total += weighted_sum(g, coef, q.dtype, keep)
                del parts
                q.grad = total if q.grad is None else q.grad + total
        return coef.detach()

    def _shared_norm_sq(
        self, p: _Pass, grads_by_param: dict[nn.Parameter, list[PerExampleGrad]]
    ) -> dict[nn.Parameter, list[PerExampleGrad]]:
        """``||sum_k G_k||^2`` for parameters used more than once: uses of the same kind are merged exactly
        (:func:`~hf_dp.layers.grads.merge`), the rest get the cross terms ``2 <G_k, G_l>``. Returns the pieces."""
        pieces = {}
        for q in list(grads_by_param):
            grads = grads_by_param.pop(q)
            if p.use_counts.get(q, 0) == 1 and not p.keep_all:
                pieces[q] = grads
                continue
            parts = merge(grads) if len(grads) > 1 else grads
            for k, gk in enumerate(parts):
                p.norm_sq += norm_sq(gk, self._norm_dtype)
                for gl in parts[k + 1 :]:
                    p.norm_sq += 2 * inner(gk, gl, self._norm_dtype)
            pieces[q] = parts
        return pieces

    def _check_no_bypass(self, p: _Pass) -> None:
        """In the one-backward modes autograd never writes ``p.grad``; if it did, a use of the parameter bypassed
        the hooks (e.g. inside the loss, after the model's forward pass) and would leak an unclipped gradient."""
        if self.mode == "ghost" or p.grads_before is None:
            return
        for q, stamp in p.grads_before.items():
            if _grad_stamp(q) != stamp:
                raise UnsupportedModuleError(
                    f"Trainable parameter `{self._names()[1].get(q, '?')}` received a gradient from autograd during "
                    "the backward pass: it is used outside the model's forward pass (e.g. in the loss), where its "
                    "gradient would not be clipped. Compute the per-example loss from the model's outputs only."
                )

    def _check_ghost_sums(self, p: _Pass, pieces: dict[nn.Parameter, list[PerExampleGrad]]) -> None:
        """Once per plan in ghost mode: autograd's gradient of the summed loss must equal the sum of the engine's
        per-example gradients (otherwise a use escaped the hooks, e.g. in the loss)."""
        if self._sum_checked:
            return
        self._sum_checked = True
        ones = torch.ones(p.size, dtype=self._norm_dtype, device=p.norm_sq.device)
        _, param_names = self._names()
        for q in self._trainable:
            expected = q.grad
            got = None
            for g in pieces.get(q, []):
                part = weighted_sum(g, ones, torch.float64)
                got = part if got is None else got + part
            if expected is None and got is None:
                continue
            expected = torch.zeros_like(got) if expected is None else expected.double()
            got = torch.zeros_like(expected) if got is None else got
            scale = float(expected.norm())
            if float((got - expected).norm()) > 1e-3 * max(scale, 1e-12) and float((got - expected).norm()) > 1e-30:
                raise UnsupportedModuleError(
                    f"Trainable parameter `{param_names.get(q, '?')}` gets a gradient that no hooked module accounts "
                    "for (it is used outside the model's forward pass, e.g. in the loss): its per-example norm would "
                    "be wrong. Compute the per-example loss from the model's outputs only."
                )
        for q in list(pieces):
            if p.use_counts.get(q, 0) == 1:
                pieces.pop(q)

    # ------------------------------------------------------------------ self-check support
    def _parameter_norms(
        self, inputs: dict, per_example_loss: Callable[[nn.Module, dict], Tensor]
    ) -> dict[nn.Parameter, Tensor]:
        """Per-parameter per-example gradient norms of ``per_example_loss(model, inputs)``, without touching
        ``p.grad`` or the state of the current micro-batch."""
        saved = (self._pass, self._prepared, self._capturing, self.per_example_norms)
        self._pass, self._prepared, self._capturing = None, False, False
        self._force_ghost_diff = True
        try:
            loss = per_example_loss(self.model, inputs)
            self._begin(loss, keep_all=True)
            p = self._pass
            leaves = list(self._origins.values())
            if p.size and p.uses and leaves:
                torch.autograd.backward(loss.sum(), inputs=leaves)
            p.phase = None
            grads_by_param: dict[nn.Parameter, list[PerExampleGrad]] = defaultdict(list)
            for use in p.uses:
                for q, g in use.grads.items():
                    grads_by_param[q].append(g)
            out = {}
            with torch.no_grad():
                for q, grads in grads_by_param.items():
                    p.norm_sq = torch.zeros(p.size, dtype=self._norm_dtype, device=loss.device)
                    self._shared_norm_sq(p, {q: grads})
                    out[q] = p.norm_sq.sqrt()
            return out
        finally:
            self._force_ghost_diff = False
            for origin in self._origins.values():
                origin.grad = None
            self._pass, self._prepared, self._capturing, self.per_example_norms = saved


def _grad_stamp(p: nn.Parameter) -> tuple:
    g = p.grad
    return (None, None) if g is None else (id(g), g._version)


def _expand_output(expand: dict, batch_size: int, record, output):
    """Probe output hook: expand the proven ``[1, ...]`` outputs of the listed calls to the batch."""
    positions = expand.get((id(record.module), record.ordinal))
    if not positions:
        return None
    leaves, spec = tree_flatten(output)
    for j in positions:
        leaves[j] = leaves[j].expand(batch_size, *leaves[j].shape[1:])
    return tree_unflatten(leaves, spec)
