"""The Gaussian noise of DP-SGD, from a source whose secret never leaves the process (DESIGN §4 rule 14).

Whoever can regenerate the noise of a step can subtract it from the released weights, so nothing that regenerates it
(a seed, a generator state) is ever written to ``output_dir``, a checkpoint or the Hub:

* default: the base seed is drawn from the operating system (``secrets``) when the source is created, i.e. at every
  start and at every resume of ``train()``; it lives in memory only;
* ``seed`` given (tests only): the base seed is that number, so the noise of every step is reproducible and a resumed
  run is bit-identical to an uninterrupted one without saving any generator state;
* ``secure=True``: every normal comes from the OS's cryptographically secure generator (``os.urandom``) by
  Box-Muller in float64, and each noise value is the sum of four such normals divided by two (the mitigation of
  floating-point attacks on Gaussian sampling of Holohan & Braghin 2021, sec. 5.1, which Opacus's secure mode also
  uses). About 32 random bytes per coordinate per step: seconds per step for a 100M-parameter model.

Each step ``s`` draws, on each device, from a fresh generator seeded by a hash of ``(base seed, s, stream, device)``,
so the noise of a step depends on the step index and the secret only, never on how many tensors earlier steps drew.
The tensors of one call that share a standard deviation come from one flat draw (one kernel), split into views.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["NoiseSource"]


def _step_seed(base: int, step: int, stream: int, device: torch.device) -> int:
    digest = hashlib.blake2b(f"{base}:{step}:{stream}:{device}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are < 2**63


def _secure_standard_normal(numel: int) -> np.ndarray:
    """``numel`` N(0, 1) values from ``os.urandom``: 53-bit uniforms in (0, 1], Box-Muller in float64."""
    pairs = (numel + 1) // 2
    bits = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs) >> np.uint64(11)
    u1 = (bits[0].astype(np.float64) + 1.0) / 2.0**53  # (0, 1]: log(u1) is finite
    u2 = bits[1].astype(np.float64) / 2.0**53
    radius = np.sqrt(-2.0 * np.log(u1))
    return np.concatenate([radius * np.cos(2 * math.pi * u2), radius * np.sin(2 * math.pi * u2)])[:numel]


class NoiseSource:
    """Gaussian noise for the noisy steps of one ``train()`` call.

    Args:
        seed (`int`, *optional*): a fixed base seed (tests only: anyone who knows it can remove the noise). `None`
            draws one from the operating system, kept in memory only.
        secure (`bool`, *optional*, defaults to `False`): draw from the OS's cryptographically secure generator.
        stream (`int`, *optional*, defaults to 0): an index mixed into every step's seed, so that several processes
            drawing independent noise (one shard each) never share a stream.

    Example:
        ```python
        source = NoiseSource()
        noise = source.normal(step=0, shapes=[(3, 4), (4,)], std=0.5, device="cpu", dtype=torch.float32)
        ```
    """

    def __init__(self, seed: int | None = None, *, secure: bool = False, stream: int = 0) -> None:
        self._base = secrets.randbits(128) if seed is None else int(seed)
        self.deterministic = seed is not None
        self.secure = secure
        self.stream = stream

    def __repr__(self) -> str:  # never show the base seed
        mode = "secure" if self.secure else ("fixed seed" if self.deterministic else "OS-seeded")
        return f"NoiseSource({mode}, stream={self.stream})"

    def __getstate__(self):
        raise TypeError("NoiseSource holds the noise secret and cannot be pickled or copied to disk.")

    def normal(
        self,
        *,
        step: int,
        shapes: Sequence[torch.Size | tuple[int, ...]],
        std: float | Sequence[float],
        device,
        dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """One N(0, std^2) tensor per shape (``std`` a number, or one per shape), the noise of step ``step`` (drawn
        in float32 or float64, then cast)."""
        device = torch.device(device)
        stds = [float(std)] * len(shapes) if isinstance(std, int | float) else [float(s) for s in std]
        draw_dtype = torch.promote_types(dtype, torch.float32)
        if self.secure:
            out = []
            for shape, sd in zip(shapes, stds, strict=True):
                numel = math.prod(shape)
                total = sum(_secure_standard_normal(numel) for _ in range(4)) / 2.0
                out.append(torch.from_numpy(total).reshape(shape).to(device=device, dtype=draw_dtype).mul_(sd))
            return [t.to(dtype) for t in out]
        generator = torch.Generator(device=device)
        generator.manual_seed(_step_seed(self._base, step, self.stream, device))
        # One flat draw per run of consecutive shapes with the same std (one kernel for all of a model's gradients),
        # split into views: every coordinate is still an independent N(0, std^2) draw from this step's stream.
        out: list[torch.Tensor] = []
        start = 0
        while start < len(shapes):
            end = start + 1
            while end < len(shapes) and stds[end] == stds[start]:
                end += 1
            run = [tuple(shape) for shape in shapes[start:end]]
            sizes = [math.prod(shape) for shape in run]
            flat = torch.normal(0.0, stds[start], (sum(sizes),), generator=generator, device=device, dtype=draw_dtype)
            flat = flat.to(dtype)
            out.extend(part.view(shape) for part, shape in zip(flat.split(sizes), run, strict=True))
            start = end
        return out
