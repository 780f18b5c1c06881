"""The forward side of ``BookKeepingClipper``: proving a plan on the first batch, installing it, and book-keeping
each hooked call (inputs kept as detached references, outputs given a gradient hook).

On the first forward pass after a (re)plan the root pre-hook runs the probe (:mod:`.probe`), builds the plan
(:mod:`.planner`), checks broadcast expansions with a third sub-batch run, installs the hooks, and verifies the real
forward pass (:mod:`.verify`). Later forward passes only switch ``requires_grad`` off (ghost differentiation), count
calls, check each call's shapes against its proven layout, and capture.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from ..layers import ScaledRule, UnsupportedModuleError
from ..layers.grads import compute_dtype
from ..layers.replay import RandomRecorder
from .batch import RootBatch, root_batch, slice_batch
from .checkpointing import (
    CHECKPOINTING_SUPPORTED,
    checkpoint_region,
    own_saved_tensors,
    reentrant_checkpointing,
)
from .coverage import HookedModule, plan_coverage, trainable_parameters
from .planner import CallLayout, Plan, build_plan, expansion_changes_output, fits, needs_third_run
from .probe import eval_mode, frozen_rng, run_probe
from .state import ModelHook, Pass, expand_output
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
        self._set_groups()
        self._norm_dtype = self._compute_norm_dtype()
        self._uninstall()
        return True

    def _uninstall(self) -> None:
        for handle in self._plan_handles:
            handle.remove()
        self._plan_handles, self._plan = [], None
        self._verified, self._support_checked, self._sum_checked = None, False, False

    def _make_plan(self, args: tuple, kwargs: dict, batch: RootBatch, first: int = 0, second: int = 1) -> Plan:
        """Prove a plan on the sub-batches ``[first]`` and ``[second, first]`` of this batch (``[first, first]`` for
        a batch of one), with ``[second, second, first]`` when a leaf is a tensor in one run only."""
        names, param_names = self._names()
        params = {id(p): p for p in self._trainable}
        devices = sorted({p.device for p in self.model.parameters()}, key=str)
        second = second if batch.size > 1 else first
        with self._inert(), frozen_rng(devices), own_saved_tensors():  # maybe inside a checkpointed region
            try:
                one = run_probe(self.model, *slice_batch(args, kwargs, batch, [first]), params)
                pair = [second, first]
                two = run_probe(self.model, *slice_batch(args, kwargs, batch, pair), params)
                three = None
                if needs_third_run(one, two):  # e.g. a mask built only when some example is padded
                    three = run_probe(self.model, *slice_batch(args, kwargs, batch, [second, second, first]), params)
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
            self._prove_expansions(plan, args, kwargs, batch, pair, two, params)
        return plan

    def _prove_expansions(self, plan: Plan, args, kwargs, batch: RootBatch, pair: list[int], two, params) -> None:
        by_id = {id(e): e for e in plan.hooked}
        expanding = [(key, layout) for key, layouts in plan.calls.items() for layout in layouts if layout.expand]
        # Expand [1, ...] outputs to `repeat` rows per example: 1, else the rows per example the model runs on
        # (multiple choice flattens [B, choices, T] to [B * choices, T]); keep the first that leaves the model's
        # output unchanged on the probe.
        changed = bool(expanding)
        for repeat in plan.repeats if expanding else ():
            expand = {}
            for (entry_id, ordinal), layout in expanding:
                layout.outputs = [
                    replace(x, repeat=repeat) if j in layout.expand else x for j, x in enumerate(layout.outputs)
                ]
                expand[(id(by_id[entry_id].module), ordinal)] = [(j, repeat) for j in layout.expand]
            try:
                expanded = run_probe(
                    self.model,
                    *slice_batch(args, kwargs, batch, pair),
                    params,
                    output_hook=functools.partial(expand_output, expand, 2),
                )
                changed = expansion_changes_output(two.output, expanded.output)
            except Exception:  # noqa: BLE001  (the model cannot take the expanded tensor)
                changed = True
            if not changed:
                break
        if changed:
            which = sorted({by_id[e].name for (e, _), lay in expanding})
            raise UnsupportedModuleError(
                f"The outputs of {which} are the same for every example ([1, ...], e.g. position ids built "
                "with batch size 1); hf_dp expands them to the batch to get their per-example gradients, but "
                "the model does not use them as a broadcast over the examples (e.g. it runs on several rows "
                "per example). Pass such inputs (e.g. `position_ids`) with one row per row of the model's "
                "batch, or freeze their parameters."
            )

    def _layout_for(self, entry: HookedModule, module: nn.Module, ordinal: int, in_leaves, out_leaves) -> CallLayout:
        """The proven layout of this call; proven now, on examples of this batch, if the call takes a path (a
        structure of tensors) that the layouts proven so far do not cover."""
        b = self._pass.size
        for layout in self._plan.calls.get((id(entry), ordinal), ()):
            if fits(layout, in_leaves, out_leaves, b):
                return layout
        return self._reprove(entry, module, ordinal, in_leaves, out_leaves)

    def _reprove(self, entry: HookedModule, module: nn.Module, ordinal: int, in_leaves, out_leaves) -> CallLayout:
        """Prove the layouts of a call in the middle of the forward pass: on sub-batches ``[0]`` and ``[j, 0]`` of
        the batch of this forward pass, for the first ``j`` whose run takes the path of this call. The new layouts
        join the plan (the next call with this structure uses them); the hooked modules and what they cover must
        be those of the plan."""
        root = self._root_call
        if root is None:
            raise UnsupportedModuleError(
                f"Call {ordinal} of module `{entry.name}` ({type(module).__name__}) runs outside the model's forward "
                "pass with a structure hf_dp did not prove."
            )
        args, kwargs, batch = root
        key = _entry_key(entry)
        devices = sorted({p.device for p in self.model.parameters()}, key=str)
        params = {id(p): p for p in self._trainable}
        target = (id(module), ordinal)
        tried = 0
        with self._inert(), frozen_rng(devices):
            for j in range(1, batch.size) if batch.size > 1 else [0]:
                two = run_probe(self.model, *slice_batch(args, kwargs, batch, [j, 0]), params)
                call = next((c for c in two.calls if (id(c.module), c.ordinal) == target), None)
                if call is None or not _same_structure(call, in_leaves, out_leaves, entry.is_fallback):
                    continue
                tried += 1
                plan = self._make_plan(args, kwargs, batch, first=0, second=j)
                new_entry = next((e for e in plan.hooked if _entry_key(e) == key), None)
                layouts = plan.calls.get((id(new_entry), ordinal), []) if new_entry is not None else []
                found = next((lay for lay in layouts if fits(lay, in_leaves, out_leaves, batch.size)), None)
                if found is None:
                    continue
                self._merge_plan(plan)
                logger.info(
                    "hf_dp: `%s` took a path not seen on the examples the plan was proven on; proved its layouts "
                    "again on examples [0] and [%d, 0] of this batch.",
                    entry.name,
                    j,
                )
                return found
        raise UnsupportedModuleError(
            f"Call {ordinal} of module `{entry.name}` ({type(module).__name__}) has inputs or outputs that no layout "
            f"proven so far describes, and no sub-batch of one or two examples of this batch takes the same path "
            f"({tried} tried) to prove one: the model arranges the examples of this batch in a way hf_dp cannot "
            f"prove. Freeze the parameters of `{entry.name}`, or make the model take the same path for every batch "
            "(e.g. always pass an attention mask)."
        )

    def _merge_plan(self, new: Plan) -> None:
        """Add the layouts of ``new`` to the current plan (same hooked modules, rules and parameters, else raise)."""
        plan = self._plan
        old_by_key = {_entry_key(e): e for e in plan.hooked}
        new_by_key = {_entry_key(e): e for e in new.hooked}
        same_shadows = set(old_by_key) == set(new_by_key) and all(
            {id(q) for q in plan.shadowing.get(id(old_by_key[k]), ())}
            == {id(q) for q in new.shadowing.get(id(new_by_key[k]), ())}
            for k in old_by_key
        )
        if not same_shadows:
            changed = sorted({k[1] for k in set(old_by_key) ^ set(new_by_key)}) or ["(shadowing)"]
            raise UnsupportedModuleError(
                f"On this batch the model uses its trainable parameters through other modules than on the batch the "
                f"plan was proven on (changed: {changed[:3]}): data-dependent control flow that hf_dp cannot follow. "
                "Make the model take the same path for every batch, or freeze the parameters involved."
            )
        new_key = {id(e): k for k, e in new_by_key.items()}
        for (entry_id, ordinal), layouts in new.calls.items():
            old = old_by_key[new_key[entry_id]]
            known = plan.calls.setdefault((id(old), ordinal), [])
            for layout in layouts:
                if not any(k.shapes == layout.shapes and k.outputs == layout.outputs for k in known):
                    known.append(layout)
        plan.repeats = tuple(sorted(set(plan.repeats) | set(new.repeats)))

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
        self._fallback_modules = {id(entry.module) for entry in plan.hooked if entry.is_fallback}
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
        if not torch.is_grad_enabled():
            return None
        if self._replan_if_changed():
            self._pass = None
        if self.model.training:
            self._check_checkpointing()
        batch = root_batch(self.model, args, kwargs)
        self._root_call = (args, kwargs, batch)  # for proving layouts of a path first taken in this pass
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
            self._pass = Pass(batch, ghost_diff=ghost_diff)
        self._pass.counts, self._pass.ordinal, self._pass.complete = {}, {}, False
        if self._plan is not None and self._verified != self.model.training and batch.size > 0:
            names, param_names = self._names()
            self._verification = Verification(self.model, self._plan.hooked, list(self._trainable), names, param_names)
            self._verification.start()
        # dropout in a module the fallback re-runs per example is recorded, to be replayed in the re-run
        self._record_random = self.model.training and bool(self._fallback_modules)
        self._pass.record_random = self._record_random
        self._capturing = True
        self._on_module_start(module, args)
        # a checkpointed region is recomputed in full (no early stop), so that every hooked call in it runs again
        self._early_stop = set_checkpoint_early_stop(False)
        self._early_stop.__enter__()
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
        if not self._capturing:
            if p.phase is not None and _recomputing():
                self._recompute_enter(module)
            return None
        if CHECKPOINTING_SUPPORTED:
            self._region_start()
        count = p.counts.get(id(module), 0)
        p.counts[id(module)] = count + 1
        p.ordinal[id(module)] = count
        for q in self._shadow_start.get(id(module), ()):
            self._shadow_depth[q] += 1
        if self._record_random and id(module) in self._fallback_modules:
            self._push_random_frame()
        return None

    def _push_random_frame(self) -> None:
        if self._recorder is None:
            self._recorder = RandomRecorder(on_draw=self._on_random_draw if CHECKPOINTING_SUPPORTED else None)
            self._recorder.__enter__()
        self._recorder.frames.append([])

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
        if reentrant:
            raise UnsupportedModuleError(
                f"Activation checkpointing of {reentrant[:3]}{' ...' if len(reentrant) > 3 else ''} is reentrant "
                "(`use_reentrant=True`, or torch's default): it runs the layers without gradients and backpropagates "
                "a second graph built in the backward pass, which book-keeping cannot follow. Enable it with "
                '`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})` (or '
                "`gradient_checkpointing_kwargs` in the training arguments)."
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


def _entry_key(entry: HookedModule) -> tuple:
    """What makes two plans' entries the same: the module, its rule (a scaled rule with its scale) and the
    parameters it covers."""
    rule = entry.rule
    scale = round(rule.scale, 9) if isinstance(rule, ScaledRule) else None
    return (id(entry.module), entry.name, type(rule).__name__, scale, frozenset(id(q) for q in entry.params))


def _kind(x) -> tuple | None:
    return (x.dim(), x.dtype) if isinstance(x, Tensor) else None


def _same_structure(call, in_leaves, out_leaves, fallback: bool) -> bool:
    """The probe's call has the same leaves as the real one (tensors where it has tensors, of the same rank)."""
    if [_kind(x) for x in call.out_leaves] != [_kind(x) for x in out_leaves]:
        return False
    return not fallback or [_kind(x) for x in call.in_leaves] == [_kind(x) for x in in_leaves]


def _recomputing() -> bool:
    region = checkpoint_region() if CHECKPOINTING_SUPPORTED else None
    return region is not None and region[0] == "recompute"
