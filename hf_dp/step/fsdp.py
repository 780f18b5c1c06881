"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under book-keeping.

FSDP2 keeps each parameter sharded along dimension 0 between steps and, for a module's forward and backward passes,
all-gathers it into an unsharded parameter that it swaps into the module. Book-keeping never lets autograd compute a
weight gradient (ghost differentiation), so FSDP's own reduce-scatter has nothing to reduce; instead:

* the clipper is built while every FSDP group is unsharded, on the unsharded parameters (FSDP2 keeps one unsharded
  parameter object per parameter after its first all-gather), with the sharded parameters as their registered twins;
* the clipped sum of each parameter over this rank's examples (full size) is handed to :meth:`FSDP2Clipping.sink`;
  once every trainable parameter of an FSDP group has its sum, one flat reduce-scatter of the group starts
  (asynchronously, a few groups at a time, so that only their full-size sums are held), and after ``finish()``
  :meth:`FSDP2Clipping.flush` adds the shards to the sharded gradients. The groups go in a fixed order (forward
  order, or backward order when the clipper delivers inside the backward pass; a group that completes early waits),
  on a process group of their own, so every rank makes the same collectives in the same order whatever its data. A
  rank whose micro-batch is empty runs a placeholder with loss weight 0 (DPTrainer) and so reduce-scatters zeros;
* a micro-batch in which the engine runs passes of its own (the proof of a plan, the support check, the self-check)
  runs with every group unsharded and resharding off (:meth:`FSDP2Clipping.collective_free`), so that those passes,
  which depend on this rank's examples, make no collective; all ranks enter it together (an all-reduced flag);
* the noise is added by every rank to its own shard from its own stream, so that every coordinate of the global sum
  is noised exactly once.

FSDP's gradient reduction is switched off for the run (:meth:`FSDP2Clipping.start`), so that nothing is reduced
twice; parameters, gradients and optimizer states stay sharded.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["FSDP2Clipping", "fsdp2_modules", "is_fsdp2"]


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return None
    return FSDPModule


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (the root first)."""
    cls = _fsdp_module_class()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or one of its modules."""
    return bool(fsdp2_modules(model))


class FSDP2Clipping:
    """The link between a ``fully_shard`` model and :class:`~hf_dp.engine.BookKeepingClipper`.

    Args:
        model (`nn.Module`): the model after ``fully_shard`` (e.g. by accelerate's FSDP plugin, ``fsdp_version=2``).
        clipped_in_backward (`bool`, *optional*, defaults to `False`): whether the clipper clips (and delivers) inside
            the backward pass (several clipping groups): the groups are then reduce-scattered in backward order (the
            last block first), else in forward order; a group that completes out of this fixed order waits.

    Raises:
        ValueError: CPU offloading, a mesh of more than one dimension (HSDP), a parameter not sharded on dim 0.
    """

    #: Flat reduce-scatters running at once (each holds its group's full-size sums until it completes).
    MAX_IN_FLIGHT = 2

    def __init__(self, model: nn.Module, *, clipped_in_backward: bool = False) -> None:
        self.model = model
        self.clipped_in_backward = clipped_in_backward
        self.modules = fsdp2_modules(model)
        groups = {}  # a state can be shared by several modules (``fully_shard([a, b])``): each group once
        for module in self.modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                groups.setdefault(id(group), group)
        self.param_groups = list(groups.values())
        self.fsdp_params = [fp for g in self.param_groups for fp in g.fsdp_params]
        from torch.distributed.tensor import Shard

        for fp in self.fsdp_params:
            if fp.sharded_param.device_mesh.ndim != 1:
                raise ValueError(
                    "hf_dp with FSDP2 supports a 1-D device mesh only (full sharding): with HSDP (a replicate "
                    "dimension) the replicas would draw different noise for the same shard. Shard over all "
                    "processes (no `dp_replicate_size`)."
                )
            if fp.sharded_param.dim() == 0 or tuple(fp.sharded_param.placements) != (Shard(0),):
                raise ValueError(
                    f"hf_dp with FSDP2 supports parameters sharded on their dimension 0 (FSDP2's default), got "
                    f"{tuple(fp.sharded_param.placements)} for a parameter of shape {tuple(fp.sharded_param.shape)}. "
                    "Leave `shard_placement_fn` unset."
                )
            if getattr(fp, "offload_to_cpu", False):
                raise ValueError(
                    "hf_dp with FSDP2 does not support CPU offloading (`offload_params`): the clipped sums are "
                    "reduce-scattered into gradients on the device. Turn offloading off."
                )
        # hf_dp's own collectives (reduce-scatters, checks) on a process group of their own, so that they never pair
        # with FSDP's all-gathers, whose order relative to them may differ across processes
        self._comm_group = None
        if self.fsdp_params:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(self.fsdp_params[0].sharded_param.device_mesh.get_group())
            self._comm_group = dist.new_group(ranks=ranks)
        self._static_order: list[int] = []
        self._ready: set[int] = set()
        self._next = 0
        self._stash: dict[int, Tensor] = {}  # id(unsharded parameter) -> this process's clipped sum
        self._unit_of: dict[int, int] = {}  # id(unsharded trainable parameter) -> index of its FSDP group in _units
        self._units: list[list] = []  # the trainable FSDPParams of each FSDP group that has any
        self._pending: list[int] = []  # per group: trainable parameters whose clipped sum has not arrived
        self._in_flight: list[tuple] = []  # (work, input, output, FSDPParams, layouts) of running reduce-scatters
        self._done: list[tuple] = []  # (FSDPParams, this process's shards) waiting for flush()

    # ------------------------------------------------------------------ state of the groups
    def unshard_all(self) -> None:
        """All-gather every group (a collective: every rank calls it at the same point)."""
        for module in self.modules:
            module.unshard()

    def reshard_all(self) -> None:
        """Free the unsharded parameters of every group (local)."""
        for group in self.param_groups:
            group.reshard()

    def start(self) -> None:
        """FSDP never reduces a gradient in this run (the clipped sums are reduce-scattered by :meth:`flush`)."""
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=False)

    @contextlib.contextmanager
    def collective_free(self) -> Iterator[None]:
        """Every group unsharded (one all-gather each, on every rank), then no reshard after forward or backward
        until the end of the block, so that the passes the engine runs on this rank's examples alone make no
        collective; resharded (locally) at the end."""
        # the root's first forward decides that it keeps its parameters after the forward (lazy init): decide it now,
        # so that what is saved and restored below is the state training runs with
        self.modules[0]._get_fsdp_state()._lazy_init()
        states = [m._get_fsdp_state() for m in self.modules]
        auto = [
            (state, state._auto_reshard_after_forward)
            for state in states
            if hasattr(state, "_auto_reshard_after_forward")
        ]
        saved = [(g, g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads) for g in self.param_groups]
        self.unshard_all()
        for module in self.modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for state, flag in auto:
                state._auto_reshard_after_forward = flag
            for group, mesh_info, after_backward, reduce_grads in saved:
                group.post_forward_mesh_info = mesh_info
                group.reshard_after_backward = after_backward
                group.reduce_grads = group.all_reduce_grads = reduce_grads
            self.reshard_all()
            for fp in self.fsdp_params:  # passes of the engine (the self-check) may have left autograd gradients
                if hasattr(fp, "_unsharded_param"):
                    fp._unsharded_param.grad = None
                if getattr(fp, "unsharded_accumulated_grad", None) is not None:  # FSDP's copy in its reduce dtype
                    fp.unsharded_accumulated_grad = None

    def registered_parameters(self) -> dict[nn.Parameter, nn.Parameter]:
        """``{unsharded: sharded}`` for every parameter (call while unsharded, e.g. inside :meth:`collective_free`);
        fixes the trainable parameters of each FSDP group, whose clipped sums :meth:`sink` then reduce-scatters."""
        mapping = {}
        self._units = []
        for group in self.param_groups:
            unit = []
            for fp in group.fsdp_params:
                mapping[fp._unsharded_param] = fp.sharded_param
                if fp.sharded_param.requires_grad:
                    self._unit_of[id(fp._unsharded_param)] = len(self._units)
                    unit.append(fp)
            if unit:
                self._units.append(unit)
        self._pending = [len(unit) for unit in self._units]
        # a fixed order of the reduce-scatters, the same on every process whatever the data (units[0] is the root's
        # group: embeddings, final norm and head, which complete last in both orders)
        blocks = list(range(1, len(self._units)))
        self._static_order = (blocks[::-1] if self.clipped_in_backward else blocks) + [0][: len(self._units)]
        self._ready, self._next = set(), 0
        return mapping

    def trainable_sharded_parameters(self) -> list[nn.Parameter]:
        """The sharded parameters whose clipped sums this object reduce-scatters (what the optimizer steps on)."""
        return [fp.sharded_param for unit in self._units for fp in unit]

    # ------------------------------------------------------------------ gradients
    def sink(self, param: nn.Parameter, clipped_sum: Tensor) -> None:
        """The clipper's ``grad_sink``: keep this process's clipped sum of ``param``; once every trainable parameter of
        its FSDP group has one, start reduce-scattering the group (so that the full-size sums of only a few groups
        are held at a time); :meth:`flush` adds the shards to the sharded gradients."""
        unit = self._unit_of.get(id(param))
        if unit is None:
            raise RuntimeError(
                "hf_dp: the clipper delivered a clipped sum for a parameter that FSDP2 does not manage as trainable."
            )
        if id(param) in self._stash:
            raise RuntimeError("hf_dp: the clipper delivered a parameter's clipped sum twice in one micro-batch.")
        self._stash[id(param)] = clipped_sum
        self._pending[unit] -= 1
        if self._pending[unit] == 0:
            self._ready.add(unit)
            self._reduce_ready()

    def _reduce_ready(self) -> None:
        """Start the reduce-scatters of the completed groups that are next in the fixed order."""
        while self._next < len(self._static_order) and self._static_order[self._next] in self._ready:
            self._reduce_unit(self._static_order[self._next])
            self._next += 1

    def flush(self) -> None:
        """After ``finish()``: reduce-scatter the groups still waiting, wait for every reduce-scatter, and add the
        shards to the sharded gradients. A group with a missing clipped sum is reduce-scattered with zeros in its place
        (so that every process makes the same collectives), and this process raises with nothing added."""
        complete = not any(self._pending)
        for unit, pending in enumerate(self._pending):
            if pending:
                for fp in self._units[unit]:
                    self._stash.setdefault(id(fp._unsharded_param), _zeros_like_full(fp.sharded_param))
                self._ready.add(unit)
        self._reduce_ready()
        while self._in_flight:
            self._complete_oldest()
        done, self._done = self._done, []
        self._ready, self._next = set(), 0
        self._pending = [len(unit) for unit in self._units]
        if not complete:  # the clipper delivers every trainable parameter (zeros if unused): an internal error
            raise RuntimeError(
                "hf_dp: a micro-batch ended before every trainable parameter's clipped sum reached its shard; nothing "
                "was added to the gradients."
            )
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for fsdp_params, shards in done:
                for fp, local in zip(fsdp_params, shards, strict=True):
                    sharded = fp.sharded_param
                    if sharded.grad is None:
                        sharded.grad = DTensor.from_local(
                            local.to(sharded.dtype, copy=True),
                            sharded.device_mesh,
                            sharded.placements,
                            run_check=False,
                            shape=sharded.shape,
                            stride=sharded.stride(),
                        )
                    else:
                        sharded.grad.to_local().add_(local)

    @torch.no_grad()
    def _reduce_unit(self, unit: int) -> None:
        """Start one flat reduce-scatter of the clipped sums of FSDP group ``unit``, asynchronously, on hf_dp's own
        process group; at most ``MAX_IN_FLIGHT`` run at a time (each holds its full-size input until it completes)."""
        import torch.distributed as dist

        fsdp_params = self._units[unit]
        fulls = [self._stash.pop(id(fp._unsharded_param)) for fp in fsdp_params]
        world = fsdp_params[0].sharded_param.device_mesh.size()
        flat, layouts = _flat_chunks(fulls, world)
        del fulls
        out = flat.new_empty(flat.shape[1])
        work = dist.reduce_scatter_tensor(out, flat.reshape(-1), group=self._comm_group, async_op=True)
        self._in_flight.append((work, flat, out, fsdp_params, layouts))
        while len(self._in_flight) > self.MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        work, flat, out, fsdp_params, layouts = self._in_flight.pop(0)
        work.wait()
        del flat
        shards, offset = [], 0
        for fp, (rows, rest) in zip(fsdp_params, layouts, strict=True):
            numel = rows * math.prod(rest)
            local_rows = fp.sharded_param.to_local().shape[0]
            shards.append(out[offset : offset + numel].view(rows, *rest)[:local_rows])
            offset += numel
        self._done.append((fsdp_params, shards))


def _zeros_like_full(sharded: Tensor) -> Tensor:
    return torch.zeros(sharded.shape, dtype=sharded.dtype, device=sharded.to_local().device)


def _flat_chunks(fulls: list[Tensor], world: int) -> tuple[Tensor, list[tuple[int, torch.Size]]]:
    """The input of one reduce-scatter for a group: each full-size sum padded along dim 0 to ``W * ceil(n / W)`` rows,
    its ``W`` row chunks laid side by side (``[W, ...]``), so that process ``r`` receives, for every parameter, the
    rows ``torch.chunk`` gives it (FSDP2's dim-0 sharding); and ``(rows per process, trailing shape)`` of each. Sums of
    several dtypes are laid out in their promoted dtype (each shard is cast back when it is added)."""
    blocks, layouts = [], []
    for full in fulls:
        rows = -(-full.shape[0] // world)  # ceil: torch.chunk's rows per process
        padded = full.new_zeros((rows * world, *full.shape[1:]))
        padded[: full.shape[0]] = full
        blocks.append(padded.reshape(world, -1))
        layouts.append((rows, full.shape[1:]))
    return torch.cat(blocks, dim=1), layouts


def local_tensor(t: Tensor) -> Tensor:
    """The part of ``t`` held by this process (a DTensor's local shard, else ``t``)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
