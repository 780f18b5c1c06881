"""``BookKeepingClipper``: per-example clipping in one backward pass (Bu et al. 2023, book-keeping).

Life of one call:
1. forward: the root pre-hook switches ``requires_grad`` off on the covered parameters (ghost differentiation:
   autograd never computes their non-private gradients) and back on in the post-hook, once the graph is built;
   each hooked module keeps its inputs (book-keeping) and registers a hook on its output.
2. ``backward(per_example_loss)``: one ``loss.sum().backward()``; each output hook receives the output gradient
   ``g`` and adds its layers' per-example squared norms (ghost norm, or instantiation where BK-MixOpt prefers it).
3. after the backward has finished (never inside a hook): parameters used more than once get their cross terms,
   total norms give ``c_i = min(1, C / (||g_i|| + 1e-6))``, and ``p.grad += sum_i c_i g_i`` is formed from the
   book-kept factors.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..layers import Captured, UnsupportedModuleError
from .coverage import HookedModule, plan_coverage, trainable_parameters
from .per_example import (
    FactoredGrad,
    PerExampleGrad,
    compute_dtype,
    inner,
    instantiate,
    norm_sq,
    weighted_sum,
)

logger = logging.getLogger(__name__)

__all__ = ["CLIPPING_MODES", "BookKeepingClipper"]

#: Clipping modes and what they do.
CLIPPING_MODES: dict[str, str] = {
    "bk": "ghost norm for every sequence layer, clipped sum from the book-kept factors (one backward)",
    "bk-mixopt": "per layer: ghost norm when 2T^2 < p*d, else instantiate the per-example gradient (one backward)",
    "per-sample": "instantiate every per-example gradient (Opacus-style, one backward)",
    "ghost": "GhostClip baseline: ghost norms from a first backward, then a second backward of the reweighted loss",
}
_BATCH_KWARGS = (
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "decoder_input_ids",
    "pixel_values",
    "labels",
)


@dataclass(eq=False)
class _Use:
    """One call of a hooked module in the current forward pass."""

    hooked: HookedModule
    captured: Captured | None
    grads: dict[nn.Parameter, PerExampleGrad] = field(default_factory=dict)


class BookKeepingClipper:
    """Per-example gradient clipping for any ``nn.Module``, by book-keeping, in one backward pass.

    Args:
        model (`nn.Module`): the model; every parameter with ``requires_grad`` is clipped per example.
        max_grad_norm (`float`): the clipping norm ``C`` (for a loss scaled by ``K``, pass ``K * C``).
        mode (`str`, *optional*, defaults to `"bk-mixopt"`): one of :data:`CLIPPING_MODES`.
        allow_fallback (`bool`, *optional*, defaults to `True`): use the torch.func rule for modules with trainable
            parameters and no closed-form rule; if `False`, such modules raise ``UnsupportedModuleError``.

    Raises:
        UnsupportedModuleError: BatchNorm anywhere in the model, or a trainable parameter no rule covers.
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
        self._root_handles: list = []
        self._module_handles: list = []
        self._hooked: list[HookedModule] = []
        self._trainable: tuple[nn.Parameter, ...] = ()
        self._uses: list[_Use] = []
        self._capturing = False  # inside a forward pass whose graph we book-keep
        self._recording = False  # inside our own backward pass
        self._batch_hint: int | None = None
        self._batch_size = 0
        self._origins: dict[tuple, Tensor] = {}
        self._norm_sq: Tensor | None = None
        self._use_counts: dict[nn.Parameter, int] = {}
        self._grads_before_ghost: dict | None = None
        self._plan()
        self._root_handles = [
            model.register_forward_pre_hook(self._on_root_forward_start, with_kwargs=True),
            model.register_forward_hook(self._on_root_forward_end, always_call=True),
        ]

    # ------------------------------------------------------------------ installation
    def _plan(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        self._hooked = plan_coverage(self.model, allow_fallback=self.allow_fallback)
        self._trainable = tuple(trainable_parameters(self.model))
        self._norm_dtype = torch.float32
        for p in self._trainable:
            self._norm_dtype = torch.promote_types(self._norm_dtype, compute_dtype(p.dtype))
        for hooked in self._hooked:
            if hooked.rule.expands_batch_one:
                self._module_handles.append(hooked.module.register_forward_pre_hook(self._expand_batch_one))
            self._module_handles.append(
                hooked.module.register_forward_hook(self._make_forward_hook(hooked), with_kwargs=True)
            )

    @property
    def hooked_modules(self) -> list[tuple[str, str]]:
        """``(module name, rule name)`` for every module the engine hooks."""
        return [(h.name, type(h.rule).__name__) for h in self._hooked]

    def remove(self) -> None:
        """Remove every hook and restore the parameters' ``requires_grad``: the model is as it was."""
        for handle in self._root_handles + self._module_handles:
            handle.remove()
        self._root_handles, self._module_handles, self._hooked = [], [], []
        for p, flag in self._original_requires_grad.items():
            p.requires_grad_(flag)
        self._uses = []
        self._origins = {}

    # ------------------------------------------------------------------ forward
    def _ghost_differentiation(self) -> bool:
        return self.mode != "ghost"

    def _on_root_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            self._capturing = False
            return
        current = [id(p) for p in trainable_parameters(self.model)]
        if current != [
            id(p) for p in self._trainable
        ]:  # requires_grad changed since the last plan: check coverage again
            self._plan()
        self._uses = []
        self._batch_hint = self._infer_batch_size(args, kwargs)
        self._capturing = True
        if self._ghost_differentiation():
            for p in self._trainable:
                p.requires_grad_(False)

    def _on_root_forward_end(self, module: nn.Module, args: tuple, output) -> None:
        if self._capturing and self._ghost_differentiation():
            for p in self._trainable:
                p.requires_grad_(True)
        self._capturing = False

    @staticmethod
    def _infer_batch_size(args: tuple, kwargs: dict) -> int | None:
        for key in _BATCH_KWARGS:
            value = kwargs.get(key)
            if isinstance(value, Tensor) and value.dim() > 0:
                return value.shape[0]
        for value in args:
            if isinstance(value, Tensor) and value.dim() > 0:
                return value.shape[0]
        return None

    def _expand_batch_one(self, module: nn.Module, args: tuple):
        """HF builds ``position_ids`` with batch size 1; an embedding lookup can be expanded to the batch safely."""
        if not self._capturing or not args or not isinstance(args[0], Tensor):
            return None
        ids = args[0]
        hint = self._batch_hint
        if hint is not None and hint > 1 and ids.dim() >= 1 and ids.shape[0] == 1:
            return (ids.expand(hint, *ids.shape[1:]), *args[1:])
        return None

    def _origin(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._origins:
            self._origins[key] = torch.zeros((), device=like.device, dtype=like.dtype, requires_grad=True)
        return self._origins[key]

    def _make_forward_hook(self, hooked: HookedModule):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output):
            if not self._capturing:
                return None
            if not isinstance(output, Tensor):
                raise UnsupportedModuleError(
                    f"Module `{hooked.name}` ({type(module).__name__}) returned {type(output).__name__}; hf_dp hooks "
                    "modules that return one tensor."
                )
            use = _Use(hooked, hooked.rule.capture(module, args, kwargs, output))
            self._uses.append(use)
            new_output = None
            if not output.requires_grad:
                # Ghost differentiation leaves this output without a graph (its inputs need no gradient and its
                # parameters are switched off); a zero scalar that requires grad gives it one at ~no cost.
                new_output = output + self._origin(output)
                output = new_output
            output.register_hook(lambda grad: self._on_output_grad(use, grad))
            return new_output

        return hook

    # ------------------------------------------------------------------ backward
    def _check_batch(self, use: _Use, grad: Tensor) -> None:
        b = self._batch_size
        tensors = [grad] + ([use.captured.args[0]] if use.captured and not use.hooked.rule.needs_kwargs else [])
        for t in tensors:
            if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != b:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"Module `{use.hooked.name}` ({type(use.hooked.module).__name__}) saw a tensor of shape {shape} "
                    f"whose first dimension is not the per-example batch ({b}); its per-example gradient would "
                    "mix examples. If these are position ids built with batch size 1, pass `position_ids` of shape "
                    "[B, T]; otherwise freeze the module's parameters."
                )

    @contextlib.contextmanager
    def _suspended(self):
        capturing, recording = self._capturing, self._recording
        self._capturing = self._recording = False
        try:
            yield
        finally:
            self._capturing, self._recording = capturing, recording

    def _per_example_grads(self, use: _Use, grad: Tensor) -> dict[nn.Parameter, PerExampleGrad]:
        with self._suspended():
            grads = use.hooked.rule.per_example_grads(use.hooked.module, use.captured, grad, set(use.hooked.params))
        if self.mode in ("bk-mixopt", "per-sample"):
            for p, g in grads.items():
                if isinstance(g, FactoredGrad) and (self.mode == "per-sample" or g.prefers_instantiation()):
                    grads[p] = instantiate(g, g.left.dtype if isinstance(g.left, Tensor) else g.right.dtype)
        return grads

    def _on_output_grad(self, use: _Use, grad: Tensor) -> None:
        if not self._recording:
            return
        self._check_batch(use, grad)
        use.grads = self._per_example_grads(use, grad)
        for p, g in use.grads.items():
            if self._use_counts[p] == 1:
                self._norm_sq += norm_sq(g, self._norm_dtype)
        use.captured = None  # the factors keep what the clipped sum needs; drop the rest
        if self.mode == "ghost":  # norms only: the second backward forms the gradient
            use.grads = {p: g for p, g in use.grads.items() if self._use_counts[p] > 1}

    def _shared_norm_sq(self, grads_by_param: dict[nn.Parameter, list[PerExampleGrad]]) -> None:
        """||sum_k G_k||^2 = sum_k ||G_k||^2 + 2 sum_{k<l} <G_k, G_l> for parameters used more than once."""
        for p, grads in grads_by_param.items():
            if self._use_counts[p] == 1:
                continue
            for k, gk in enumerate(grads):
                self._norm_sq += norm_sq(gk, self._norm_dtype)
                for gl in grads[k + 1 :]:
                    self._norm_sq += 2 * inner(gk, gl, self._norm_dtype)

    def backward(self, per_example_loss: Tensor) -> Tensor:
        """Accumulate ``sum_i min(1, C / (||g_i|| + 1e-6)) g_i`` into ``p.grad`` of every trainable parameter.

        One ``per_example_loss.sum().backward()`` (two in ``"ghost"`` mode), then the clipped sum.

        Args:
            per_example_loss (`torch.Tensor`): shape ``[B]``; entry ``i`` must depend on example ``i`` alone.

        Returns:
            `torch.Tensor`: the ``[B]`` clipping coefficients (0 for an example whose gradient is not finite).
        """
        self.prepare(per_example_loss)
        if self._batch_size == 0:
            return self.finish()
        try:
            per_example_loss.sum().backward(retain_graph=self.mode == "ghost")
        finally:
            self._recording = False
        return self.finish(per_example_loss if self.mode == "ghost" else None)

    def prepare(self, per_example_loss: Tensor) -> None:
        """Start book-keeping the backward pass of ``per_example_loss`` that the caller is about to run.

        For callers that run the backward themselves (the Trainer, through accelerate's loss scaling): call
        ``prepare(loss)``, then any backward of ``w * loss.sum()`` (``w`` a positive constant, e.g. a loss scale), then
        ``finish(loss_scale=w)``; ``p.grad`` then receives ``w * sum_i clip_C(g_i)``.
        """
        if per_example_loss.dim() != 1:
            raise ValueError(
                f"`per_example_loss` must have shape [B] (one loss per example), got {tuple(per_example_loss.shape)}. "
                "A batch-mean loss couples examples and voids the DP bound."
            )
        if self.mode == "ghost" and not per_example_loss.requires_grad:
            raise ValueError("`per_example_loss` does not require grad.")
        batch_size = per_example_loss.shape[0]
        self._batch_size = batch_size
        self._norm_sq = torch.zeros(batch_size, dtype=self._norm_dtype, device=per_example_loss.device)
        counts: dict[nn.Parameter, int] = defaultdict(int)
        for use in self._uses:
            for p in use.hooked.params:
                counts[p] += 1
        self._use_counts = counts
        self._grads_before_ghost = None
        if self.mode == "ghost":
            self._grads_before_ghost = {p: p.grad for p in self._trainable}
            for p in self._trainable:  # the first backward must not add into the accumulated gradients
                p.grad = None
        self._recording = batch_size > 0

    def finish(self, per_example_loss: Tensor | None = None, *, loss_scale: float = 1.0) -> Tensor:
        """Clip after the backward pass has finished and add the clipped sum to ``p.grad``.

        Args:
            per_example_loss (`torch.Tensor`, *optional*): the same loss again, for ``"ghost"`` mode's second backward.
            loss_scale (`float`, *optional*, defaults to 1): ``w`` if the backward ran on ``w * loss.sum()``: norms are
                divided by it before clipping (so clipping happens at ``w * C`` in the units of the backward, as in
                Li et al. 2022, App. T, for fp16 loss scaling) and ``p.grad`` receives ``w`` times the clipped sum.

        Returns:
            `torch.Tensor`: the ``[B]`` clipping coefficients.
        """
        self._recording = False
        if not loss_scale > 0:
            raise ValueError(f"`loss_scale` must be > 0, got {loss_scale}.")
        if self._batch_size == 0:
            self.per_example_norms = self._norm_sq
            self._uses = []
            return self._norm_sq
        grads_by_param: dict[nn.Parameter, list[PerExampleGrad]] = defaultdict(list)
        for use in self._uses:
            for p, g in use.grads.items():
                grads_by_param[p].append(g)
        self._shared_norm_sq(grads_by_param)
        norms = self._norm_sq.sqrt() / loss_scale
        coef = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        finite = torch.isfinite(norms)
        coef = torch.where(finite, coef, torch.zeros_like(coef))
        keep = None if bool(finite.all()) else finite
        self.per_example_norms = norms.detach()
        if self.mode == "ghost":
            if per_example_loss is None:
                raise ValueError("`ghost` mode needs the per-example loss again for its second backward pass.")
            for p in self._trainable:
                p.grad = self._grads_before_ghost[p]
            with self._suspended():
                (per_example_loss * coef.to(per_example_loss.dtype)).sum().backward()
        else:
            self._uses = []  # from here on grads_by_param holds the only references to the book-kept factors
            for p in list(grads_by_param):
                grads = grads_by_param.pop(p)  # freed as we go: the peak is not "all factors + all gradients"
                total = weighted_sum(grads[0], coef, p.dtype, keep)
                for g in grads[1:]:
                    total += weighted_sum(g, coef, p.dtype, keep)
                del grads
                p.grad = total if p.grad is None else p.grad + total
        self._uses = []
        for origin in self._origins.values():
            origin.grad = None
        return coef.detach()
