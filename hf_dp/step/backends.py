"""Where a DP step runs: one process or data parallel (DDP), or fully sharded (FSDP2).

A back end answers the few questions on which :class:`~hf_dp.step.dp_step.DPStep` differs between them, so that the
step itself reads as the algorithm:

* which parameters the optimizer steps on (FSDP2: the sharded ones), and which tensor of each this process noises;
* who adds which noise: the Gaussian noise must reach every coordinate of the global clipped sum exactly once. With
  DDP the main process adds it to its share of the sum before the all-reduce; with FSDP2 every process adds it to its
  own shard, from its own stream. The counts released with the gradient (fp16 overflows, adaptive clipping) are
  noised by the main process;
* what is summed over processes after the noise (DDP: the gradients and counts; FSDP2: the counts, the gradients
  having been reduce-scattered into their shards after each micro-batch);
* how a micro-batch runs: DDP must not reduce in autograd (book-keeping writes ``p.grad`` itself); FSDP2 builds the
  clipper on the sharded model at the first micro-batch, runs the engine's own passes with every group unsharded and
  no collective, and raises an error of one process on all of them.

The collectives are in :mod:`hf_dp.step.distributed`; FSDP2's sharded clipped sums in :mod:`hf_dp.step.fsdp`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .distributed import all_reduce_sum_, any_process
from .fsdp import FSDP2Clipping, local_tensor

__all__ = ["DataParallel", "FullySharded"]


class DataParallel:
    """One process, or DDP (each process holds the whole model and the clipped sum of its own examples).

    Args:
        model (`nn.Module`): the model (unwrapped): its trainable parameters are those the optimizer steps on.
        is_main_process (`bool`, *optional*, defaults to `True`): whether this process adds the noise.
        num_processes (`int`, *optional*, defaults to 1): processes whose sums are all-reduced after the noise.
    """

    #: The index of this process's noise stream (every process of a DDP run draws the same stream; only the main one
    #: adds its noise).
    noise_stream = 0

    def __init__(self, model: nn.Module, *, is_main_process: bool = True, num_processes: int = 1) -> None:
        self.model = model
        self.is_main_process = is_main_process
        self.num_processes = num_processes

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps on."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def local_gradients(self, parameters: list[nn.Parameter]) -> list[Tensor]:
        """The gradient tensors this process holds (the noise targets)."""
        return [p.grad for p in parameters]

    def noise_targets(
        self, grads: list[Tensor], dropped: Tensor | None, count: Tensor | None
    ) -> tuple[list[Tensor], Tensor | None, Tensor | None]:
        """What this process noises: everything on the main process (before the all-reduce), nothing elsewhere."""
        return (grads, dropped, count) if self.is_main_process else ([], None, None)

    def reduce(self, grads: list[Tensor], dropped: Tensor | None, count: Tensor | None) -> None:
        """Sum the noised gradients and counts over processes (each then holds the global, once-noised sums)."""
        if self.num_processes > 1:
            all_reduce_sum_(
                [*grads, *([dropped] if dropped is not None else []), *([count] if count is not None else [])]
            )

    @contextlib.contextmanager
    def micro_batch(self, step: Any, model: nn.Module, *, batch_size: Callable[[], int], needs_self_check: bool):
        """Run one micro-batch (nothing to set up on one process or under DDP)."""
        yield

    def without_gradient_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """DDP must not reduce: book-keeping puts the clipped sums in ``p.grad`` outside autograd, and they are
        all-reduced once per logical step (:meth:`reduce`), so a rank with an empty micro-batch can skip the backward
        without a deadlock."""
        return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()

    def after_accumulate(self) -> None:
        """Nothing to do: the clipped sums are in ``p.grad``."""

    def defer(self, error: Exception) -> None:
        """An error of this process's micro-batch: raised at once."""
        raise error

    def failing_together(self) -> contextlib.AbstractContextManager:
        """Errors are raised where they happen (no other process waits in a collective of the micro-batch)."""
        return contextlib.nullcontext()


class FullySharded:
    """FSDP2 (``fully_shard``): each process holds shards of the parameters, gradients and optimizer states.

    Args:
        clipped_in_backward (`bool`): whether the clipper delivers clipped sums inside the backward pass (several
            clipping groups): the reduce-scatters then follow backward order (:class:`~hf_dp.step.fsdp.FSDP2Clipping`).
        process_index (`int`): this process (each process noises its own shards from its own stream).
        is_main_process (`bool`): whether this process noises the counts.
        num_processes (`int`): processes whose counts are all-reduced.
        build_clipper (`Callable`): ``build_clipper(model, grad_sink=..., registered_parameters=...)`` returns the
            clipper of the run, built at the first micro-batch on the sharded model.
        device (`torch.device`): where the flags shared by the processes live.
    """

    def __init__(
        self,
        *,
        clipped_in_backward: bool,
        process_index: int,
        is_main_process: bool,
        num_processes: int,
        build_clipper: Callable[..., Any],
        device: torch.device | str,
    ) -> None:
        self.clipped_in_backward = clipped_in_backward
        self.noise_stream = process_index
        self.is_main_process = is_main_process
        self.num_processes = num_processes
        self.build_clipper = build_clipper
        self.device = device
        self.sharding: FSDP2Clipping | None = None  # set at the first micro-batch, on the sharded model
        self._deferred: Exception | None = None

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The sharded parameters (also while the model holds the unsharded ones in a collective-free micro-batch)."""
        return self.sharding.trainable_sharded_parameters()

    def local_gradients(self, parameters: list[nn.Parameter]) -> list[Tensor]:
        """This process's shard of every gradient."""
        if any(not hasattr(p.grad, "to_local") for p in parameters):
            raise RuntimeError("hf_dp: FSDP2 noise must go to the sharded gradients (DTensors).")
        return [local_tensor(p.grad) for p in parameters]

    def noise_targets(
        self, grads: list[Tensor], dropped: Tensor | None, count: Tensor | None
    ) -> tuple[list[Tensor], Tensor | None, Tensor | None]:
        """Every process noises its own shards; the main process the count (fp16 is refused with FSDP2)."""
        return grads, None, count if self.is_main_process else None

    def reduce(self, grads: list[Tensor], dropped: Tensor | None, count: Tensor | None) -> None:
        """The shards are already global sums (reduce-scattered per micro-batch): only the count is summed."""
        if count is not None and self.num_processes > 1:
            all_reduce_sum_([count])

    @contextlib.contextmanager
    def micro_batch(
        self, step: Any, model: nn.Module, *, batch_size: Callable[[], int], needs_self_check: bool
    ) -> Iterator[None]:
        """Run one micro-batch. One in which any process may run passes of the engine's own (the proof of a plan,
        the support check, the self-check) runs with the whole model on every process, so that they start no
        collective; the clipper is built then, at the first micro-batch, on the sharded model."""
        if self.sharding is None:
            self.sharding = FSDP2Clipping(model, clipped_in_backward=self.clipped_in_backward)
        self.sharding.start()
        planning = step.clipper is None or step.clipper.needs_own_passes(batch_size()) or needs_self_check
        if not any_process(planning, device=self.device):
            yield
            return
        with self.sharding.collective_free():
            if step.clipper is None:
                step.clipper = self.build_clipper(
                    model, grad_sink=self.sharding.sink, registered_parameters=self.sharding.registered_parameters()
                )
            step.clipper.allow_own_passes = True
            try:
                yield
            finally:
                step.clipper.allow_own_passes = False

    def without_gradient_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """FSDP's own gradient reduction is off for the run (:meth:`FSDP2Clipping.start`)."""
        return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()

    def after_accumulate(self) -> None:
        """Reduce-scatter the clipped sums into the sharded gradients."""
        self.sharding.flush()

    def defer(self, error: Exception) -> None:
        """An error of this process's micro-batch (a refused batch, a failed self-check): raised with the other
        processes, in :meth:`failing_together`, instead of leaving them waiting in their next collective."""
        self._deferred = error

    @contextlib.contextmanager
    def failing_together(self) -> Iterator[None]:
        """An error of this process's forward pass, loss, ``prepare()`` (e.g. a layout it cannot prove) or a deferred
        one is raised on every process, before the backward pass (one all-reduced flag per micro-batch)."""
        error, self._deferred = self._deferred, None
        if error is None:
            try:
                yield
            except Exception as raised:
                error = raised
        if any_process(error is not None, device=self.device):
            if error is not None:
                raise error
            raise RuntimeError(
                "hf_dp: another process failed in the forward pass of this micro-batch (see its error); stopping so "
                "that no process waits for it."
            )
