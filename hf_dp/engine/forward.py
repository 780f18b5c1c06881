"""The forward side of ``BookKeepingClipper``: the root model's hooks, installing a plan, module starts.

On the first forward pass after a (re)plan the root pre-hook has the plan proven (:mod:`.proof`), installs the hooks,
and verifies the real forward pass (:mod:`.verify`). Every forward pass switches ``requires_grad`` off (ghost
differentiation) and counts module calls; each hooked call is book-kept by :mod:`.capture`. Activation checkpointing
(reentrant or not) is checked here and followed by :mod:`.regions` (:mod:`.checkpointing`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections import defaultdict

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import set_checkpoint_early_stop

from ..layers import UnsupportedModuleError
from ..layers.grads import compute_dtype
from ..layers.replay import RandomFrame, RandomRecorder, draws_random_numbers
from .batch import RootBatch, root_batch
from .checkpointing import (
    CHECKPOINTING_SUPPORTED,
    REENTRANT_SUPPORTED,
    checkpoint_region,
    reentrant_checkpointing,
    reentrant_forward,
)
from .coverage import plan_coverage, trainable_parameters
from .listing import ModelListing
from .planner import Plan
from .state import ModelHook, Pass
from .verify import Verification

logger = logging.getLogger("hf_dp.engine.clipper")

__all__ = ["ForwardHooks"]


class ForwardHooks:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: planning and the forward-pass hooks."""

    # ------------------------------------------------------------------ plan
    def _compute_norm_dtype(self) -> torch.dtype:
        dtype = torch.float32
        for p in self._trainable:
            dtype = torch.promote_types(dtype, compute_dtype(p.dtype))
        return dtype

    @contextlib.contextmanager
    def _inert(self):
        """Every hook of the engine stands aside (the engine runs the model, a rule or the self-check itself), the
        recorder of random draws too: a probe or rule check run inside a fallback module's forward (a layout proven
        again mid-pass) draws numbers of its own, which are no draws of that module."""
        recorder = self._recorder
        frames = recorder.frames if recorder is not None else None
        if recorder is not None:
            recorder.frames = []
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1
            if recorder is not None:
                recorder.frames = frames

    def _names(self, listing: ModelListing | None = None) -> tuple[dict[int, str], dict[nn.Parameter, str]]:
        """Module names by id and parameter names (``listing``: the model's, if the caller has just listed it)."""
        listing = ModelListing.of(self.model) if listing is None else listing
        modules = {}
        for name, module in listing.named_modules:
            modules.setdefault(id(module), name)
        params = {}
        for name, p in listing.named_parameters:
            params.setdefault(self._used_of.get(id(p), p), name)
        return modules, params

    def _set_trainable_requires_grad(self, flag: bool) -> None:
        """``requires_grad`` of every trainable parameter the forward pass uses, and of its registered twin (FSDP2
        copies the sharded parameter's flag onto the unsharded one whenever it all-gathers)."""
        for p in self._trainable:
            p.requires_grad_(flag)
            twin = self._registered.get(p)
            if twin is not None:
                twin.requires_grad_(flag)

    def _replan_if_changed(self) -> bool:
        current = trainable_parameters(self.model)
        if self._used_of:
            current = [self._used_of.get(id(p), p) for p in current]
        if len(current) == len(self._trainable) and all(map(operator.is_, current, self._trainable)):
            return False
        # requires_grad changed: check coverage again, and prove a new plan on the next batch
        self._static = plan_coverage(self.model, allow_fallback=self.allow_fallback)
        self._trainable = tuple(current)
        self._set_groups()
        self._norm_dtype = self._compute_norm_dtype()
        self._uninstall()
        return True

    def _uninstall(self) -> None:
        for handle in self._plan_handles:
            handle.remove()
        self._plan_handles, self._plan = [], None
        self._verified, self._support_checked, self._sum_checked = None, False, False

    def _install(self, plan: Plan) -> None:
        for handle in self._plan_handles:
            handle.remove()
        self._plan_handles = []
        modules: dict[int, nn.Module] = {}
        for entry in plan.hooked:
            modules[id(entry.module)] = entry.module
            hook = ModelHook(functools.partial(self._on_forward, entry))
            self._plan_handles.append(
                entry.module.register_forward_hook(hook, with_kwargs=True, prepend=True, always_call=True)
            )
        for module in modules.values():
            if module is not self.model:  # the root's own start is handled by the root pre-hook
                self._plan_handles.append(module.register_forward_pre_hook(ModelHook(self._on_module_start)))
        # the modules whose random draws are recorded: the fallback's (replayed in its re-run), and those of rules
        # that read them
        self._fallback_modules = {id(e.module): e.name for e in plan.hooked if e.is_fallback or e.rule.records_random}
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
        if self._pass is not None and self._pass.phase is not None and _recomputing():
            self._recompute_enter(module)  # the whole model is checkpointed: this is its recomputation
            return None
        self._drop_unfinished()
        if not torch.is_grad_enabled():
            self._check_not_in_reentrant_region()
            return None
        if self._replan_if_changed():
            self._pass = None
        if self.model.training:
            self._check_checkpointing()
        batch = root_batch(self.model, args, kwargs)
        self._root_call = (args, kwargs, batch)  # for proving layouts of a path first taken in this pass
        names = None  # module and parameter names, for messages (read once for the plan and its verification)
        if batch.size > 0 and self._plan is None:
            listing = ModelListing.of(self.model)  # read by each step below
            self._check_grad_hooks(listing)  # a hook added since the last plan (grad_hooks)
            names = self._names(listing)
            self._install(self._make_plan(args, kwargs, batch, names=names, listing=listing))
            self._pass = None
        self._start_pass(batch)
        if self.packed_sequences and batch.size > 0:  # the examples are the sequences of the rows
            self._start_packed(kwargs, batch.size)
        if self._plan is not None and self._verified != self.model.training and batch.size > 0:
            self._start_verification(names if names is not None else self._names())
        self._start_capture(module, args)
        return None

    def _drop_unfinished(self) -> None:
        """A new forward pass starts: parameters back in autograd after a recomputation, and the capture of a
        forward pass that raised, or a prepared micro-batch that no ``finish()`` consumed, dropped."""
        self._recompute_leave()
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

    def _start_pass(self, batch: RootBatch) -> None:
        """The pass that book-keeps this forward pass: a new one, or the one of the forward passes before it that no
        ``prepare()`` consumed yet (same batch size and differentiation)."""
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
            self._pass = Pass(batch, ghost_diff=ghost_diff)
        self._pass.counts, self._pass.ordinal, self._pass.complete = {}, {}, False

    def _start_verification(self, names: tuple[dict[int, str], dict[nn.Parameter, str]]) -> None:
        """Verify the plan on this forward pass (the first one in each of training and eval mode)."""
        module_names, param_names = names
        self._verification = Verification(
            self.model, self._plan.hooked, list(self._trainable), module_names, param_names
        )
        self._verification.start()
        if REENTRANT_SUPPORTED and self._verification.mode is not None:
            # uses in the forward of a reentrant region run without gradients: verify them too
            self._verification.mode.grad_mode_only = _GradModeOnly(self)

    def _start_capture(self, module: nn.Module, args: tuple) -> None:
        """Start book-keeping the forward pass: the root's own start, checkpoint early stop off, and ghost
        differentiation's parameters out of autograd."""
        # dropout in a module the fallback re-runs per example is recorded, to be replayed in the re-run
        self._record_random = self.model.training and bool(self._fallback_modules)
        self._pass.record_random = self._record_random
        self._capturing = True
        self._on_module_start(module, args)
        # a checkpointed region is recomputed in full (no early stop), so that every hooked call in it runs again
        self._early_stop = set_checkpoint_early_stop(False)
        self._early_stop.__enter__()
        if self._pass.ghost_diff:
            self._set_trainable_requires_grad(False)

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
        self._stop_copies()
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            recorder.frames = []
            recorder.__exit__(None, None, None)
        self._record_random = False
        self._root_call = None
        if self._early_stop is not None:
            early_stop, self._early_stop = self._early_stop, None
            early_stop.__exit__(None, None, None)
        self._stop_verification()
        if self._capturing and self._pass is not None and self._pass.ghost_diff:
            self._set_trainable_requires_grad(True)
        self._capturing = False

    def _stop_verification(self) -> None:
        if self._verification is not None:
            verification, self._verification = self._verification, None
            verification.stop()

    def _on_module_start(self, module: nn.Module, args: tuple) -> None:
        p = self._pass
        if self._internal or p is None:
            return None
        if not self._capturing:
            reentrant = self._reentrant_top() is not None and torch.is_grad_enabled()
            if p.phase is not None and (_recomputing() or reentrant):
                self._recompute_enter(module)
            return None
        if CHECKPOINTING_SUPPORTED:
            self._region_start(module)
        count = p.counts.get(id(module), 0)
        p.counts[id(module)] = count + 1
        p.ordinal[id(module)] = count
        for q in self._shadow_start.get(id(module), ()):
            self._shadow_depth[q] += 1
        if self._record_random and id(module) in self._fallback_modules:
            self._push_random_frame(self._fallback_modules[id(module)])
        return None

    def _push_random_frame(self, name: str) -> None:
        if self._recorder is None:
            self._recorder = _Recorder(on_draw=self._on_random_draw if CHECKPOINTING_SUPPORTED else None)
            self._recorder.__enter__()
        self._recorder.frames.append(RandomFrame(name))

    def _check_checkpointing(self) -> None:
        """Refuse activation checkpointing the engine cannot follow, before the forward pass (training only)."""
        on = [m for m in self._checkpointable if getattr(m, "gradient_checkpointing", False) is True]
        if on and not CHECKPOINTING_SUPPORTED:
            raise UnsupportedModuleError(
                "Activation checkpointing is on, and this version of torch does not let hf_dp tell a checkpointed "
                "forward pass from its recomputation. Call `model.gradient_checkpointing_disable()` (or set "
                "`gradient_checkpointing=False`)."
            )
        reentrant = reentrant_checkpointing(self.model) if on else []
        if reentrant and not REENTRANT_SUPPORTED:
            raise UnsupportedModuleError(
                f"Activation checkpointing of {reentrant[:3]}{' ...' if len(reentrant) > 3 else ''} is reentrant "
                "(`use_reentrant=True`, or torch's default), and this version of torch does not let hf_dp follow "
                "its recomputation. Enable it with `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                '{"use_reentrant": False})` (or `gradient_checkpointing_kwargs` in the training arguments).'
            )

    def _check_not_in_reentrant_region(self) -> None:
        """The root model itself runs in the forward of a reentrant checkpoint region (without gradients): refused
        if the region has a graph (its recomputation would be the model's only forward pass with gradients)."""
        call = reentrant_forward() if REENTRANT_SUPPORTED else None
        if call is not None and any(isinstance(x, Tensor) and x.requires_grad for x in call.inputs):
            raise UnsupportedModuleError(
                "The model runs inside reentrant activation checkpointing (`torch.utils.checkpoint.checkpoint(model, "
                "..., use_reentrant=True)`): hf_dp book-keeps the model's own forward pass, which then runs without "
                "gradients. Checkpoint the model's layers instead, or pass `use_reentrant=False`."
            )

    def _pop_random_frame(self) -> list:
        recorder = self._recorder
        if recorder is None or not recorder.frames:
            return []
        frame = recorder.frames.pop()
        if not recorder.frames:
            self._recorder = None
            recorder.__exit__(None, None, None)
        return frame

    def _origin(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._origins:
            self._origins[key] = torch.zeros((), device=like.device, dtype=like.dtype, requires_grad=True)
        return self._origins[key]


class _Recorder(RandomRecorder):
    """The forward pass's recorder of random draws in fallback modules. :class:`RandomRecorder` stands aside without
    gradients; in the forward of a reentrant region (which runs without gradients) it records as with gradients,
    on detached tensors, so that the region draws as its recomputation will, and the engine sees each draw
    (:attr:`reentrant`: the region of the draw being recorded)."""

    reentrant = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.frames or torch.is_grad_enabled() or not draws_random_numbers(func, args, kwargs):
            return super().__torch_function__(func, types, args, kwargs)
        call = reentrant_forward() if REENTRANT_SUPPORTED else None
        if call is None:
            return super().__torch_function__(func, types, args, kwargs)
        args, kwargs = tree_map_only(Tensor, Tensor.detach, (args, kwargs))
        self.reentrant = call
        try:
            with torch.enable_grad():
                return super().__torch_function__(func, types, args, kwargs)
        finally:
            self.reentrant = None


class _GradModeOnly:
    """``grad_mode_only`` of the verification's use recorder: false (check every use) inside the forward of a
    reentrant checkpoint region, where the uses run without gradients (and the engine's own work stands aside)."""

    def __init__(self, clipper: ForwardHooks) -> None:
        self.clipper = clipper

    def __bool__(self) -> bool:
        return torch.is_grad_enabled() or self.clipper._internal > 0 or reentrant_forward() is None


def _recomputing() -> bool:
    region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
    return region is not None and region[0] == "recompute"
