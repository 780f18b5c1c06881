"""The training DataLoader of a DP run: Poisson logical batches (of examples or of users), cut into micro-batches.

Each logical batch includes every unit independently with probability q (drawn from a secret seed: the sampling is
part of the mechanism, :mod:`hf_dp.sampling.poisson`), and is cut into ``gradient_accumulation_steps`` micro-batches,
which may be empty. The collator is wrapped so that an empty micro-batch still yields a batch
(:class:`~hf_dp.sampling.collators.EmptyBatchSafeCollator`), and so that each batch carries the number of examples the
sampler put in it and, for user-level DP, the user of each row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from .batch_checks import NUM_EXAMPLES_KEY
from .collators import EmptyBatchSafeCollator
from .cyclic import CyclicPoissonBatchSampler, CyclicPoissonUserBatchSampler
from .poisson import PoissonBatchSampler
from .privacy_unit import UNIT_KEY, UnitTaggedDataset
from .users import PoissonUserBatchSampler

__all__ = ["poisson_dataloader", "rank_aware"]


def poisson_dataloader(
    dataset,
    collator: Callable[[list], Any],
    *,
    sample_rate: float,
    num_micro_batches: int,
    seed: int,
    draw_offset: int = 0,
    secure: bool = False,
    num_replicas: int = 1,
    rank: int = 0,
    user_codes: np.ndarray | None = None,
    max_examples_per_user: int | None = None,
    lengths: Sequence[int] | None = None,
    fsdp_placeholder: bool = False,
    bands: int | None = None,
    steps_per_epoch: int | None = None,
    **dataloader_kwargs: Any,
) -> DataLoader:
    """A DataLoader of Poisson micro-batches over ``dataset``.

    Args:
        sample_rate (`float`): q, the probability that a unit is in a logical batch.
        num_micro_batches (`int`): micro-batches per logical batch (``gradient_accumulation_steps``).
        seed (`int`): the secret sampling seed; ``draw_offset``: the index of the first logical batch to draw (draws
            already used by earlier steps of the run are never drawn again).
        secure (`bool`): draw the inclusions from a cryptographic stream.
        num_replicas, rank (`int`): the data-parallel processes (each gets its share of every logical batch).
        user_codes (`np.ndarray`, *optional*): the user of every row (user-level DP: users are sampled, and at most
            ``max_examples_per_user`` rows of each).
        lengths (*optional*): row lengths, to group each micro-batch's rows by length (``group_by_length``).
        fsdp_placeholder (`bool`): every FSDP2 rank runs every micro-batch (their collectives are shared), so an empty
            one carries the first example, to run with loss weight 0 (it adds exactly nothing).
        bands (`int`, *optional*): cyclic Poisson sampling over this many parts (banded correlated noise,
            :mod:`hf_dp.sampling.cyclic`); ``sample_rate`` is then the rate of a part, ``b L / N``.
        steps_per_epoch (`int`, *optional*): logical batches per epoch (default: ``floor(1 / sample_rate)``).
        dataloader_kwargs: passed to ``DataLoader`` (workers, pinning, ...).
    """
    common = {"seed": seed, "draw_offset": draw_offset, "secure": secure, "num_replicas": num_replicas, "rank": rank}
    common["steps_per_epoch"] = steps_per_epoch
    if bands is not None:
        common["bands"] = bands
    if user_codes is not None:
        dataset = UnitTaggedDataset(dataset, user_codes)
        sampler = (PoissonUserBatchSampler if bands is None else CyclicPoissonUserBatchSampler)(
            user_codes, sample_rate, num_micro_batches, max_examples_per_user=max_examples_per_user, **common
        )
    else:
        sampler = (PoissonBatchSampler if bands is None else CyclicPoissonBatchSampler)(
            len(dataset), sample_rate, num_micro_batches, lengths=lengths, **common
        )
    collate = EmptyBatchSafeCollator(
        collator,
        placeholder=partial(_first_example, dataset) if fsdp_placeholder else None,
        count_key=NUM_EXAMPLES_KEY,  # checked against the per-example losses (hf_dp.sampling.batch_checks)
        unit_key=UNIT_KEY if user_codes is not None else None,  # the user of each row, for clipping per user
    )
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **dataloader_kwargs)


def rank_aware(prepared: DataLoader, sampler) -> DataLoader:
    """``prepared`` (by accelerate) with its re-sharding wrapper, if any, made a passthrough: the Poisson sampler
    already gives each rank its share."""
    wrapper = getattr(prepared, "batch_sampler", None)
    if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
        wrapper.num_processes, wrapper.process_index = 1, 0
    return prepared


def _first_example(dataset) -> list:
    return [dataset[0]]
