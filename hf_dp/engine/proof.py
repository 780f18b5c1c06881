"""Proving a plan: on sub-batches of the first batch, and again in the middle of a forward pass when a call takes a
path (a structure of tensors) the proven layouts do not describe.

The plan is proven on examples ``[0]`` and ``[1, 0]`` of the first batch (:mod:`.probe`, :mod:`.planner`), and the
broadcast expansions it makes are checked on a third run. A model can take another path on another batch, e.g.
T5 builds its encoder attention mask only when some example of the batch is padded: the probed examples may have
had no mask. Each layout keeps the shapes it was proven on (:func:`~.layouts.fits`); a call that no layout fits is
proven again on examples ``[0]`` and ``[j, 0]`` of the batch in progress, for the first ``j`` that takes its path,
and the new layouts join the plan (the hooked modules and what they cover must not change).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import replace

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..layers import ScaledRule, UnsupportedModuleError
from .batch import RootBatch, check_bags, describe, slice_batch
from .checkpointing import own_saved_tensors
from .coverage import HookedModule
from .listing import ModelListing
from .module_state import kept_state
from .planner import CallLayout, Plan, build_plan, expansion_changes_output, fits, needs_third_run
from .probe import Prober, frozen_rng, probe_mode, run_expanded, run_probe
from .shared_outputs import CopyTaint, copied_calls
from .state import expand_output

logger = logging.getLogger("hf_dp.engine.clipper")

__all__ = ["PlanProof"]


class PlanProof:
    """Mixin of :class:`~hf_dp.engine.BookKeepingClipper`: prove, extend and merge plans."""

    def _make_plan(
        self,
        args: tuple,
        kwargs: dict,
        batch: RootBatch,
        first: int = 0,
        second: int = 1,
        *,
        names=None,
        training_like: bool = False,
        listing: ModelListing | None = None,
    ) -> Plan:
        """Prove a plan on the sub-batches ``[first]`` and ``[second, first]`` of this batch (``[first, first]`` for
        a batch of one), with ``[second, second, first]`` when a leaf is a tensor in one run only. ``names``: the
        model's ``_names()``, ``listing``: the model's :class:`~.listing.ModelListing`, if the caller has them."""
        self._check_own_passes("prove a plan")
        listing = ModelListing.of(self.model) if listing is None else listing
        names, param_names = names if names is not None else self._names(listing)
        params = {id(p): p for p in self._trainable}
        second = second if batch.size > 1 else first
        pair = [second, first]

        def failed(err: Exception) -> UnsupportedModuleError:
            return UnsupportedModuleError(
                "hf_dp proves where the examples lie in every layer by running the model on sub-batches of 1 "
                f"and 2 examples cut out of this batch ({describe(batch)}), and "
                f"that run failed: {type(err).__name__}: {err}. Pass batch-first inputs whose examples can be "
                "sliced along dimension 0."
            )

        def third_run():
            # made when the plan first reads a leaf that is a tensor in one of the first two runs only
            try:
                with prober:  # the first two runs' prober again (it tracks rows if the first run found them routed)
                    return prober.run(*slice_batch(args, kwargs, batch, [second, second, first]), params, uses=False)
            except UnsupportedModuleError:
                raise
            except Exception as err:
                raise failed(err) from err

        # one eval mode, one set of probe hooks for runs 1-2 (maybe in a checkpointed region), module state put back
        with self._proving(training_like, listing):
            try:
                with Prober(self.model) as prober:
                    one = prober.run(*slice_batch(args, kwargs, batch, [first]), params)
                    # the plan reads the uses of the parameters off the first run only
                    sub = slice_batch(args, kwargs, batch, pair)
                    two = prober.run(*sub, params, uses=False)
            except UnsupportedModuleError:
                raise
            except Exception as err:
                raise failed(err) from err
            check_bags(batch, *sub, two.calls)  # bags of flat inputs: an EmbeddingBag takes them
            # e.g. a mask built only when some example is padded: the third run, if the plan reads such a leaf
            three = third_run if needs_third_run(one, two) else None
            plan = build_plan(
                self._static, one, two, names, param_names, allow_fallback=self.allow_fallback, three=three
            )
            self._prove_expansions(plan, args, kwargs, batch, pair, two, params)
        return plan

    @contextlib.contextmanager
    def _proving(self, training_like: bool, listing: ModelListing):
        """The state :meth:`_make_plan` runs the model in: the engine's hooks inert, the module state and random
        numbers put back afterwards, the probe's mode (maybe in a checkpointed region: the engine's own saved
        tensors). ``listing``: the model as listed on entry."""
        model = self.model
        with (
            self._inert(),
            kept_state(model, listing.modules) as modules,  # for the flags eval mode puts back
            frozen_rng(listing.devices()),
            own_saved_tensors(),
            probe_mode(model, training_like, modules),
        ):
            yield

    def _prove_expansions(self, plan: Plan, args, kwargs, batch: RootBatch, pair: list[int], two, params) -> None:
        """Expand the proven ``[1, ...]`` outputs to the batch if the model's output stays the same with them all
        expanded (HF position embeddings added to the batch: one run). Else defer those that reach the model's output
        through the model's own copies of them along the batch alone (a prompt computed once and repeated, which an
        expansion would copy ``B`` times; the model computes as it would without hf_dp: :mod:`.shared_outputs`), and
        expand the others if the model's output stays the same with them expanded; else refuse. (Either way, the
        first batch's support check then proves that each example's loss reads its own rows alone.)"""
        by_id = {id(e): e for e in plan.hooked}
        expanding = [(key, layout) for key, layouts in plan.calls.items() for layout in layouts if layout.expand]
        if not expanding:
            return
        sub = slice_batch(args, kwargs, batch, pair)
        taint = CopyTaint()
        if self._expansions_hold(plan, expanding, sub, two, by_id, taint) and not taint.copied:
            return
        calls = {(id(by_id[e].module), ordinal): layout.expand for (e, ordinal), layout in expanding}
        copied = copied_calls(self.model, sub, calls)
        kept = [((e, ordinal), lay) for (e, ordinal), lay in expanding if (id(by_id[e].module), ordinal) not in copied]
        if self._expansions_hold(plan, kept, sub, two, by_id):
            for (e, ordinal), layout in expanding:
                if (id(by_id[e].module), ordinal) in copied:
                    layout.deferred = True
                    layout.outputs = [
                        replace(x, repeat=1) if j in layout.expand else x for j, x in enumerate(layout.outputs)
                    ]
            return
        which = sorted({by_id[e].name for (e, _), _ in expanding})
        raise UnsupportedModuleError(
            f"The outputs of {which} are the same for every example ([1, ...], e.g. position ids built "
            "with batch size 1, or a prompt computed once); hf_dp gets their per-example gradients from the model's "
            "copies of them along the batch (`repeat`, `expand`, `expand_as`, `broadcast_to`, `tile`, "
            "`repeat_interleave` along dimension 0), or else by expanding them to the batch, but the model reaches "
            "its output from them otherwise than through such copies alone, and does not use them as a broadcast "
            "over the examples either (expanded, its output changes: e.g. it runs on several rows per example). "
            "Pass such inputs (e.g. `position_ids`) with one row per row of the model's batch, or freeze their "
            "parameters."
        )

    def _expansions_hold(
        self, plan: Plan, expanding: list, sub: tuple, two, by_id: dict, taint: CopyTaint | None = None
    ) -> bool:
        """Whether some choice of rows per example for the ``expanding`` calls' ``[1, ...]`` outputs (the others
        left as they are) leaves the model's output on the probe unchanged (their layouts are left at that choice).
        ``taint``: watches the runs for copies of the expanded outputs (its ``copied`` is that of the last run)."""
        if not expanding:
            return True
        # Expand [1, ...] outputs to `repeat` rows per example: 1, else the rows per example the model runs on
        # (multiple choice flattens [B, choices, T] to [B * choices, T]); keep the first that leaves the model's
        # output unchanged on the probe. First the rows per example of each call's caller (Swin adds a [1, h, w, w]
        # bias to the attention of the windows of each example, a number that differs from stage to stage), then
        # one repeat for every call.
        own = [_caller_rows(two, by_id[entry_id].module, ordinal) for (entry_id, ordinal), _ in expanding]
        choices = ([own] if all(r is not None for r in own) and len(set(own)) > 1 else []) + [
            [repeat] * len(expanding) for repeat in plan.repeats
        ]
        for repeats in choices:
            expand = {}
            for ((entry_id, ordinal), layout), repeat in zip(expanding, repeats, strict=True):
                layout.outputs = [
                    replace(x, repeat=repeat) if j in layout.expand else x for j, x in enumerate(layout.outputs)
                ]
                expand[(id(by_id[entry_id].module), ordinal)] = [(j, repeat) for j in layout.expand]
            hook = functools.partial(expand_output, expand, 2)
            if taint is not None:
                taint.reset()  # this run's copies only
                hook = functools.partial(_tainted_output, hook, taint)
            try:
                with taint if taint is not None else contextlib.nullcontext():
                    expanded = run_expanded(
                        self.model,
                        *sub,
                        [by_id[entry_id].module for (entry_id, _), _ in expanding],
                        hook,
                        in_eval_mode=True,  # inside `_make_plan`'s
                    )
                changed = expansion_changes_output(two.output, expanded)
            except Exception:  # noqa: BLE001  (the model cannot take the expanded tensor)
                changed = True
            if not changed:
                return True
        return False

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
        self._check_own_passes(f"prove a new path of `{entry.name}`")
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
        # in eval mode first (dropout off, as the plan was proven); a model in training whose training forward takes
        # another path (XLNet returns its memories in eval mode only) then in its training flags, dropout off
        modes = [False, True] if any(m.training for m in self.model.modules()) else [False]
        with self._inert(), frozen_rng(devices), kept_state(self.model):
            for training_like, j in ((t, j) for t in modes for j in (range(1, batch.size) if batch.size > 1 else [0])):
                two = run_probe(
                    self.model,
                    *slice_batch(args, kwargs, batch, [j, 0]),
                    params,
                    uses=False,
                    training_like=training_like,
                )
                call = next((c for c in two.calls if (id(c.module), c.ordinal) == target), None)
                if call is None or not _same_structure(call, in_leaves, out_leaves, entry.is_fallback):
                    continue
                tried += 1
                plan = self._make_plan(args, kwargs, batch, first=0, second=j, training_like=training_like)
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


def _entry_key(entry: HookedModule) -> tuple:
    """What makes two plans' entries the same: the module, its rule (a scaled rule with its scale) and the
    parameters it covers."""
    rule = entry.rule
    scale = round(rule.scale, 9) if isinstance(rule, ScaledRule) else None
    return (id(entry.module), entry.name, type(rule).__name__, scale, frozenset(id(q) for q in entry.params))


def _tainted_output(hook, taint: CopyTaint, record, output):
    """``hook``'s replacement of a call's output, its tensors tainted (:class:`~.shared_outputs.CopyTaint`)."""
    replaced = hook(record, output)
    if replaced is not None:
        taint.taint(t for t in tree_flatten(replaced)[0] if isinstance(t, Tensor))
    return replaced


def _kind(x) -> tuple | None:
    return (x.dim(), x.dtype) if isinstance(x, Tensor) else None


def _same_structure(call, in_leaves, out_leaves, fallback: bool) -> bool:
    """The probe's call has the same leaves as the real one (tensors where it has tensors, of the same rank)."""
    if [_kind(x) for x in call.out_leaves] != [_kind(x) for x in out_leaves]:
        return False
    return not fallback or [_kind(x) for x in call.in_leaves] == [_kind(x) for x in in_leaves]


def _caller_rows(two, module: nn.Module, ordinal: int) -> int | None:
    """Rows per example of the largest batch-first tensor input of the nearest call around ``module``'s call
    ``ordinal`` that has one, in the run on two examples (``None`` if none has)."""
    call = next((c for c in two.calls if c.module is module and c.ordinal == ordinal), None)
    while call is not None and call.parent is not None:  # the nearest caller with such an input (Swin-V2's bias MLP
        call = two.calls[call.parent]  # runs in an `nn.Sequential` on a table without examples)
        rows = [
            x.shape[0] // 2
            for x in call.in_leaves
            if isinstance(x, Tensor) and x.is_floating_point() and x.dim() > 0 and x.shape[0] % 2 == 0
        ]
        if rows:
            return max(rows)
    return None
