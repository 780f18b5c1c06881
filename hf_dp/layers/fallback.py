"""Generic rule for any module with trainable parameters and no closed-form rule (compare Opacus ``functorch.py``).

Per-example gradients come from re-running the module's own forward on each example alone:
``G_i = d/dtheta sum_j <y_j(theta; x_i), g_{i,j}>`` over the module's tensor outputs ``y_j`` with their output
gradients ``g_{i,j}`` (``torch.func.vmap`` of ``torch.func.grad`` over ``functional_call``; a plain loop of autograd
calls where ``vmap`` cannot run the module). This instantiates ``[B, *param.shape]`` and re-runs the forward once,
so it is exact but slower than a closed-form rule.

Any module works: several inputs, keyword arguments, tuple or ``ModelOutput`` outputs (non-tensor parts pass
through; only floating-point outputs that received a gradient count), the root model itself, and parameters of
submodules (a module the engine made responsible for parameters used inside its forward). The engine proves, for
every input and output tensor, which dimension carries the examples (:class:`~hf_dp.layers.base.Layout`); inputs
without one (masks, position ids shared by every example) are passed whole to every example.

Exact only if the re-run computes what the original forward did: random draws (dropout in training) recorded in
the forward pass are replayed per example (:mod:`.replay`, with the loop), and a module that changes its buffers
when run (running statistics) is refused.
"""

from __future__ import annotations

import contextlib
import logging
import random
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

from .base import Captured, LayerRule, Layout, UnsupportedModuleError, autocast_like
from .grads import InstantiatedGrad, PerExampleGrad
from .replay import RandomReplayer, refuse_routed_draws

__all__ = ["FALLBACK_RULE", "FallbackRule"]

logger = logging.getLogger(__name__)
_LOOP_MODULES: weakref.WeakSet = weakref.WeakSet()  # modules vmap could not run: use the loop


class _Inputs:
    """The module's call split into per-example tensors (batched leaves) and the rest."""

    def __init__(self, captured: Captured, in_layouts: list, batch_size: int) -> None:
        self.leaves, self.spec = tree_flatten((tuple(captured.args), dict(captured.kwargs)))
        self.layouts = in_layouts
        self.batch_size = batch_size
        self.batched: list[Tensor] = []  # [..., B, k, ...] along each leaf's dim
        self.dims: list[int] = []
        for leaf, layout in zip(self.leaves, in_layouts, strict=True):
            if isinstance(leaf, Tensor) and layout is not None and not layout.broadcast:
                k = layout.rows(leaf, batch_size)
                self.batched.append(leaf.unflatten(layout.dim, (batch_size, k)))
                self.dims.append(layout.dim)

    def rebuild(self, per_example: list[Tensor]):
        it = iter(per_example)
        rebuilt = [
            next(it) if isinstance(leaf, Tensor) and lay is not None and not lay.broadcast else leaf
            for leaf, lay in zip(self.leaves, self.layouts, strict=True)
        ]
        return tree_unflatten(rebuilt, self.spec)


class FallbackRule(LayerRule):
    needs_kwargs = True
    layout = "any"

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        return list(module.parameters(recurse=False))

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Captured:
        return Captured(args=tuple(args), kwargs=dict(kwargs))

    def per_example_grads(
        self, module: nn.Module, captured: Captured, grad_output, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        """Per-example gradients of the ``trainable`` parameters of ``module`` and its submodules for one call.

        ``grad_output`` is one tensor, or a list aligned with the flattened outputs (``None`` where an output got no
        gradient). Without ``captured.layouts`` the examples are taken along dimension 0 of every tensor whose first
        size is the batch (the batch being the first dimension of the output gradient).
        """
        named = {name: p for name, p in module.named_parameters() if p in trainable}
        if not named:
            return {}
        grads = list(grad_output) if isinstance(grad_output, list | tuple) else [grad_output]
        in_layouts, out_layouts, batch_size = _call_layouts(captured, grads)
        inputs = _Inputs(captured, in_layouts, batch_size)
        used = [(j, g, out_layouts[j]) for j, g in enumerate(grads) if g is not None]
        if not used:
            return {}
        out_grads = [g.unflatten(lay.dim, (batch_size, lay.rows(g, batch_size))) for _, g, lay in used]
        out_dims = [lay.dim for _, _, lay in used]
        broadcast = [bool(captured.expanded) and captured.expanded[j] for j, _, _ in used]
        positions = [j for j, _, _ in used]
        params = {name: p.detach() for name, p in named.items()}
        objective = _example_objective(
            module, captured, inputs, len(out_layouts), positions, out_dims, broadcast, batch_size
        )
        versions = [b._version for b in module.buffers()]
        host_streams = _HostRandomStreams()
        try:
            per_example = None
            if module not in _LOOP_MODULES and not captured.random:
                per_example = _vmapped_grads(module, objective, params, inputs, out_grads, out_dims, batch_size)
            if per_example is None:
                replay = _replay(module, captured, batch_size)
                per_example = self._loop(objective, params, inputs, out_grads, out_dims, batch_size, replay)
            host_streams.check(module, sorted(named))
        finally:
            host_streams.restore()
            if versions != [b._version for b in module.buffers()]:
                raise UnsupportedModuleError(
                    f"{type(module).__name__} changed its buffers in its forward pass (e.g. running statistics); "
                    "re-running it for per-example gradients would change them again. Freeze its parameters or "
                    "turn the buffer updates off (`track_running_stats=False`)."
                )
        return {named[name]: InstantiatedGrad(value.detach()) for name, value in per_example.items()}

    @staticmethod
    def _loop(objective, params, inputs: _Inputs, out_grads, out_dims, batch_size: int, replay) -> dict[str, Tensor]:
        rows: dict[str, list[Tensor]] = {name: [] for name in params}
        for i in range(batch_size):
            example_inputs = [x.select(d, i) for x, d in zip(inputs.batched, inputs.dims, strict=True)]
            example_grads = [g.select(d, i) for g, d in zip(out_grads, out_dims, strict=True)]
            replayer = replay(i) if replay is not None else contextlib.nullcontext()
            with torch.enable_grad(), _same_random_stream(), replayer:
                leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
                total = objective(leaves, example_inputs, example_grads, torch.tensor(i, device=out_grads[0].device))
            if replay is not None:
                replayer.finish()
            with torch.enable_grad():
                if total.requires_grad:
                    got = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
                else:
                    got = [None] * len(leaves)
            for (name, p), g in zip(leaves.items(), got, strict=True):
                rows[name].append(torch.zeros_like(p) if g is None else g)
        return {name: torch.stack(values) for name, values in rows.items()}


def _call_layouts(captured: Captured, grads: list) -> tuple[list, list, int]:
    """The layouts of the call's flattened inputs and outputs, and the batch size: the proven ones, or dimension 0
    of every tensor whose first size is the batch of the output gradients."""
    if captured.layouts is not None:
        in_layouts, out_layouts = captured.layouts
        return in_layouts, out_layouts, captured.batch_size
    batch_size = next(g for g in grads if g is not None).shape[0]
    leaves, _ = tree_flatten((tuple(captured.args), dict(captured.kwargs)))
    in_layouts = [
        Layout(0) if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch_size else None for x in leaves
    ]
    return in_layouts, [Layout(0)] * len(grads), batch_size


def _example_objective(
    module: nn.Module,
    captured: Captured,
    inputs: _Inputs,
    num_outputs: int,
    positions: list[int],
    out_dims: list[int],
    broadcast: list[bool],
    batch_size: int,
) -> Callable:
    """``objective(params, example_inputs, example_grads, index)``: ``sum_j <y_j, g_j>`` over the outputs that got a
    gradient (``positions`` among the flattened outputs) of the module re-run with ``params`` on example ``index``
    alone, whose gradient with respect to ``params`` is that example's gradient."""

    def objective(
        params: dict[str, Tensor], example_inputs: list[Tensor], example_grads: list[Tensor], index: Tensor
    ) -> Tensor:
        args, kwargs = inputs.rebuild(example_inputs)
        with autocast_like(captured.autocast):  # the precision the forward computed in
            out = torch.func.functional_call(module, params, tuple(args), kwargs)
        out_leaves, _ = tree_flatten(out)
        if len(out_leaves) != num_outputs:
            raise UnsupportedModuleError(
                f"{type(module).__name__} returned {len(out_leaves)} outputs for one example but "
                f"{num_outputs} for the batch; the torch.func fallback cannot match them."
            )
        total = None
        for j, g, dim, shared in zip(positions, example_grads, out_dims, broadcast, strict=True):
            out_j = _example_rows(out_leaves[j], g, dim, shared, index, batch_size)
            if out_j.shape != g.shape:  # a broadcast here would sum other examples' rows in silently
                raise UnsupportedModuleError(
                    f"{type(module).__name__} re-run on one example returned output {j} of shape "
                    f"{tuple(out_leaves[j].shape)}, but that example's rows of the batch's output have shape "
                    f"{tuple(g.shape)}: an input the engine passed whole (proven shared by every example) is "
                    "not shared on this batch."
                )
            term = (out_j * g.to(out_j.dtype)).sum()
            total = term if total is None else total + term
        return total

    return objective


def _example_rows(out: Tensor, g: Tensor, dim: int, shared: bool, index: Tensor, batch_size: int) -> Tensor:
    """The rows of one example's re-run output ``out`` that its output gradient ``g`` is for."""
    if shared and out.dim() == g.dim() and out.shape[dim] == 1 and out.shape != g.shape:
        # a [1, ...] output the forward expanded to `repeat` rows per example (Swin's bias over the windows of each
        # example): each of those rows is this output
        return out.expand(g.shape)
    if out.shape != g.shape and _whole_batch(out, g, dim, batch_size):
        # Every input passed whole (shared), and the call built the whole batch's rows from them (e.g.
        # `position_embeddings.expand(batch_size, ...)`, Perceiver and ProphetNet take the batch size): this
        # example's output is its own rows of that output.
        rows = out.unflatten(dim, (batch_size, g.shape[dim]))
        pick = torch.nn.functional.one_hot(index, batch_size).to(rows.dtype)
        return torch.tensordot(rows.movedim(dim, -1), pick, dims=([rows.dim() - 1], [0]))
    return out


def _vmapped_grads(
    module: nn.Module,
    objective: Callable,
    params: dict,
    inputs: _Inputs,
    out_grads: list,
    out_dims: list,
    batch_size: int,
) -> dict[str, Tensor] | None:
    """The per-example gradients by ``vmap`` over the examples, or ``None`` where ``vmap`` cannot run the module
    (remembered: the module then uses the loop)."""
    try:
        return torch.func.vmap(
            torch.func.grad(objective), in_dims=(None, inputs.dims, out_dims, 0), randomness="error"
        )(params, inputs.batched, out_grads, torch.arange(batch_size, device=out_grads[0].device))
    except UnsupportedModuleError:
        raise
    except Exception as err:  # noqa: BLE001  (vmap cannot run every module: fall back to a loop)
        if "random" in str(err).lower():
            raise UnsupportedModuleError(
                f"{type(module).__name__} draws random numbers in its forward pass (e.g. dropout with "
                "p > 0); the torch.func fallback re-runs the forward per example and cannot reproduce "
                "them. Set its dropout probabilities to 0 or freeze its parameters."
            ) from err
        logger.info("hf_dp: vmap cannot run %s (%s); using a per-example loop", type(module).__name__, err)
        _LOOP_MODULES.add(module)
        return None


def _replay(module: nn.Module, captured: Captured, batch_size: int) -> Callable[[int], RandomReplayer] | None:
    """``replay(i)``: the forward's recorded random draws of example ``i``, to replay in its re-run (``None``: none
    recorded)."""
    if not captured.random:
        return None
    refuse_routed_draws(module)
    name = type(module).__name__

    def replay(i: int) -> RandomReplayer:
        return RandomReplayer(captured.random, batch_size, i, name)

    return replay


@contextlib.contextmanager
def _same_random_stream():
    """A re-run draws (and discards) random numbers of its own: leave training's random stream as it was."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _whole_batch(out: Tensor, grad: Tensor, dim: int, batch_size: int) -> bool:
    """Whether ``out`` is ``grad``'s shape with ``batch_size`` times its rows along ``dim``."""
    if out.dim() != grad.dim() or batch_size == 1:
        return False
    expected = list(grad.shape)
    expected[dim] *= batch_size
    return list(out.shape) == expected


class _HostRandomStreams:
    """numpy's and Python's global random streams around a re-run: a draw there (SpecAugment masks drawn with
    ``np.random`` inside a module the fallback re-runs) cannot be recorded and replayed like torch's, so the re-run
    computed with other numbers than the forward pass did: refused, and the streams are left as they were."""

    def __init__(self) -> None:
        self.python = random.getstate()
        self.numpy = np.random.get_state() if np is not None else None

    def _numpy_moved(self) -> bool:
        if self.numpy is None:
            return False
        now = np.random.get_state()
        return now[2:] != self.numpy[2:] or not np.array_equal(now[1], self.numpy[1])

    def check(self, module: nn.Module, names: list[str]) -> None:
        moved = [m for m, yes in (("numpy", self._numpy_moved()), ("random", random.getstate() != self.python)) if yes]
        if moved:
            raise UnsupportedModuleError(
                f"{type(module).__name__} draws random numbers from {' and '.join(f'`{m}`' for m in moved)} in its "
                f"forward pass (e.g. SpecAugment masks, `mask_time_prob` / `mask_feature_prob`), and the torch.func "
                f"fallback that covers its own parameters {names} re-runs that forward per example: the re-run draws "
                "other numbers than the forward pass did, so its per-example gradients would be wrong. Freeze those "
                "parameters (`requires_grad_(False)`: the draws then happen once, in the forward pass, and training "
                "is exact) or turn the draws off (`mask_time_prob=0`, `mask_feature_prob=0`)."
            )

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            np.random.set_state(self.numpy)


FALLBACK_RULE = FallbackRule()
