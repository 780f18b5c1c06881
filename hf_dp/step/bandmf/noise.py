"""Correlated noise of BandMF: at step ``t`` row ``t`` of ``W = C^{-1} Z``, from the run's secret noise stream.

``Z``'s row ``s`` is exactly what :class:`~hf_dp.step.noise.NoiseSource` draws at step ``s`` with std 1 (the same
secret, the same per-step seeding, the same devices and streams: on one process or under DDP the main process noises
the whole sum, under FSDP2 each process its shards with its own stream), so ``b = 1`` is today's DP-SGD bit for bit.
``C`` is lower-triangular banded Toeplitz with coefficients ``c_0 .. c_{b-1}``, so ``C W = Z`` is the recursion

    w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0,

which needs the last ``b - 1`` rows of ``W`` only: ``b - 1`` tensors of the noised shapes per device, in the draw
dtype (float32 for float32 or bfloat16 gradients; float64 in the float64 tests). The recursion is stable (the roots
of ``sum c_k x^k`` lie outside the unit circle, checked by the strategy), so float32 rounding does not accumulate:
measured against the float64 recursion on the same ``Z``, at most 1e-5 absolute on values of RMS 3 over 5,000 steps
with ``b = 64``, the order of the rounding of the noised sum itself.

The rows kept are a secret: with them anyone can compute the noise of the coming steps (it is a function of them and
of ``z_t``) and subtract part of it. They live in memory only: the source refuses pickling, has no ``state_dict``,
and its ``repr`` shows no numbers.

Resume. A first call at step ``s > 0`` continues a run:

* base source with a fixed seed (``base.deterministic``, tests only): rows ``0 .. s-1`` are replayed from the base
  source, so a resumed run adds exactly the noise of an uninterrupted one;
* base source seeded by the OS at this start (training): the secret of the earlier start is gone, so the recursion
  starts again from zero rows at ``s`` (no replay, which would cost ``s`` full draws and give nothing: fresh rows
  are independent of the released past either way). The noise of the whole run is then ``C'^{-1} Z`` for the
  block-diagonal ``C' = diag(C_{0:s}, C_{s:n})``: still lower-triangular, ``b``-banded, each column norm at most 1,
  which is what the amplified analysis uses of ``C`` (each participation's column in rows ``t .. t+b-1``). The
  accounting of the run's ``T`` steps as ``ceil(T / b)`` rounds also needs every unit to keep its sampling part
  across the restart; ``DPTrainer`` draws the parts afresh at each start and so refuses an OS-seeded resume
  (``trainers/banded.py``). The error of the workload is slightly larger after the restart.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from ..noise import NoiseSource
from .strategy import BandedToeplitzStrategy

__all__ = ["CorrelatedNoiseSource"]


class _DeviceState:
    """The rows of ``W`` kept for one device: the shapes, the last step, the last ``b - 1`` rows (newest first)."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, bands: int) -> None:
        self.shapes = shapes
        self.dtype = dtype
        self.step = -1
        self.rows: deque[list[torch.Tensor]] = deque(maxlen=max(bands - 1, 1))  # rows[0]: the last step's


class CorrelatedNoiseSource:
    """Gaussian noise correlated across steps by a banded Toeplitz strategy: the noise of step ``t`` is row ``t`` of
    ``C^{-1} Z`` times ``std``, ``Z`` drawn from ``base``.

    Args:
        base (`NoiseSource`): the run's secret stream (its rows ``Z``).
        strategy (`BandedToeplitzStrategy`): the coefficients of ``C``.

    Example:
        ```python
        source = CorrelatedNoiseSource(NoiseSource(), optimize_banded_toeplitz(1000, 8))
        noise = source.normal(step=0, shapes=[(3, 4)], std=0.5, device="cpu", dtype=torch.float32)
        ```
    """

    def __init__(self, base: NoiseSource, strategy: BandedToeplitzStrategy) -> None:
        if not isinstance(base, NoiseSource):
            raise TypeError(f"`base` must be a NoiseSource, got {type(base).__name__}")
        if not isinstance(strategy, BandedToeplitzStrategy):
            raise TypeError(f"`strategy` must be a BandedToeplitzStrategy, got {type(strategy).__name__}")
        self.base = base
        self.strategy = strategy
        self._coefficients = tuple(float(c) for c in strategy.coefficients)
        self._states: dict[torch.device, _DeviceState] = {}

    @property
    def bands(self) -> int:
        """``b``: the number of rows the recursion reaches back, plus one."""
        return len(self._coefficients)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the kept rows of ``W`` (all devices)."""
        return sum(t.numel() * t.element_size() for state in self._states.values() for row in state.rows for t in row)

    def __repr__(self) -> str:  # no coefficient, seed or noise value
        return f"CorrelatedNoiseSource(bands={self.bands}, base={self.base!r})"

    def __getstate__(self):
        raise TypeError(
            "CorrelatedNoiseSource holds the noise secret (the last rows of the correlated noise, from which the "
            "coming noise can be computed) and cannot be pickled or copied to disk."
        )

    def normal(
        self,
        *,
        step: int,
        shapes: Sequence[torch.Size | tuple[int, ...]],
        std: float | Sequence[float],
        device,
        dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """Row ``step`` of ``C^{-1} Z``, one tensor per shape, times ``std`` (a number or one per shape), in ``dtype``.

        Raises:
            ValueError: for a step before the last one of this device, or shapes that changed since the first call.
        """
        if self.bands == 1:
            return self.base.normal(step=step, shapes=shapes, std=std, device=device, dtype=dtype)
        device = torch.device(device)
        draw_dtype = torch.promote_types(dtype, torch.float32)
        shapes = [tuple(shape) for shape in shapes]
        rows = self._row(int(step), shapes, device, draw_dtype)
        stds = [float(std)] * len(shapes) if isinstance(std, int | float) else [float(s) for s in std]
        if len(stds) != len(shapes):
            raise ValueError(f"`std` has {len(stds)} entries for {len(shapes)} shapes.")
        return [(row * sd).to(dtype) for row, sd in zip(rows, stds, strict=True)]

    def _row(
        self, step: int, shapes: list[tuple[int, ...]], device: torch.device, draw_dtype: torch.dtype
    ) -> list[torch.Tensor]:
        state = self._states.get(device)
        if state is None:
            state = self._states[device] = _DeviceState(shapes, draw_dtype, self.bands)
            state.step = -1 if self.base.deterministic else step - 1  # OS-seeded resume: the recursion restarts
        elif state.shapes != shapes or state.dtype != draw_dtype:
            raise ValueError(
                f"The noised shapes or dtype on {device} changed between steps ({len(state.shapes)} tensors of "
                f"{state.dtype} before, {len(shapes)} of {draw_dtype} now): the correlated noise continues the same "
                "tensors at every step. Keep the set of trainable parameters fixed during training."
            )
        if step == state.step and state.rows:
            return state.rows[0]
        if step < state.step:
            raise ValueError(
                f"Correlated noise was asked for step {step} after step {state.step}: steps must increase (the "
                "noise of a past step is never drawn again)."
            )
        while state.step < step:
            self._advance(state, device)
        return state.rows[0]

    @torch.no_grad()
    def _advance(self, state: _DeviceState, device: torch.device) -> None:
        """One step of ``w_t = (z_t - sum_j c_j w_{t-j}) / c_0``."""
        state.step += 1
        row = self.base.normal(step=state.step, shapes=state.shapes, std=1.0, device=device, dtype=state.dtype)
        for coefficient, previous in zip(self._coefficients[1:], state.rows, strict=False):
            torch._foreach_add_(row, previous, alpha=-coefficient)
        torch._foreach_div_(row, self._coefficients[0])
        state.rows.appendleft(row)
