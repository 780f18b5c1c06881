"""Collective helpers for data-parallel DP training."""

from __future__ import annotations

import torch

__all__ = ["all_reduce_sum_", "any_process", "broadcast_from_main"]


@torch.no_grad()
def all_reduce_sum_(tensors: list[torch.Tensor], *, bucket_elements: int = 2**24) -> None:
    """Sum ``tensors`` in place over all processes, in flat buckets (one all-reduce per ~16M elements per dtype)."""
    import torch.distributed as dist

    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    for t in tensors:
        groups = buckets.setdefault((t.device, t.dtype), [[]])
        if groups[-1] and sum(x.numel() for x in groups[-1]) + t.numel() > bucket_elements:
            groups.append([])
        groups[-1].append(t)
    for groups in buckets.values():
        for group in groups:
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_from_main(values: list) -> list:
    """``values`` of the main process on every process (a no-op without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    box = list(values)
    dist.broadcast_object_list(box, src=0)
    return box


def any_process(flag: bool, *, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` holds on any process (every process must call it at the same point)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    box = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box.item())
