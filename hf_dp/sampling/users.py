"""Poisson sampling of users (user-level DP), each contributing at most ``k`` of its rows to a logical batch.

With user-level DP the unit of the guarantee is a user: every row of one person. Each logical batch includes each
*user* independently with probability ``q`` (the subsampling the accountants assume, now over ``U`` users); a sampled
user contributes at most ``k = max_examples_per_user`` of its rows, and the clipper bounds the norm of the sum of that
user's per-example gradients by ``C``. Adding or removing a user then changes the noised sum by at most ``C``, whatever
the number of its rows, which is the sensitivity the accountants assume.

Which rows a sampled user contributes. Any rule that depends only on the user's own rows and on randomness independent
of the data keeps the sensitivity at ``C``: a fixed chunk (say the first ``k`` rows of the user, or a chunk that rotates
with the step) is a deterministic function of the data that still bounds the contribution, and is as valid for the
analysis as a random subset. We choose a *fresh uniformly random subset* of ``min(k, n_u)`` rows at every step, so that
over the run every row of a user can be trained on (each row of a sampled user is used with probability
``min(k, n_u) / n_u``, no row is left out for good as with the first ``k``, and which rows train is not tied to the step
number as with rotating chunks), and the bound ``k`` holds at every step. The subset is drawn from a stream keyed by
``(seed, draw)`` distinct from the inclusion stream, one key per row of the training set: a user's subset depends on
its own rows' keys only, not on which other users were sampled.

Keys. Logical batch ``draw`` includes user ``u`` when the ``u``-th uniform of ``(seed, draw)`` is below ``q``, exactly
as :class:`~hf_dp.sampling.poisson.PoissonBatchSampler` includes examples (the same generator, over ``num_users``). The
row subsets use the child stream ``SeedSequence([seed, draw]).spawn(1)[0]`` of PCG64, or, with ``secure=True``,
SHAKE-256 of ``"{seed}:{draw}:rows"`` (the inclusion bits then come from SHAKE-256 of ``"{seed}:{draw}"``): both
streams are cryptographic in secure mode. The seed must stay secret (see :mod:`hf_dp.sampling.poisson`) and is never
shown.

Micro-batches. The users of a logical batch, in increasing code order, are shared among the ranks as whole users
(``users[rank::num_replicas]``); each rank then cuts its users, in that order, into exactly ``num_micro_batches``
contiguous groups balancing the row counts (a user goes to the micro-batch where the middle of its rows falls; some
micro-batches may be empty). All the rows of a user are in one micro-batch, contiguous, so that one backward pass sees
every per-example gradient of the user it clips as one, and the Trainer's accumulation boundaries are the logical-batch
boundaries.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Hashable, Iterator, Sequence

import numpy as np

from .poisson import _PoissonSchedule, _uniforms

__all__ = ["PoissonUserBatchSampler", "encode_users"]


def _is_missing(value) -> bool:
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN, NaT
    except TypeError:  # pandas.NA: its comparisons are NA, whose truth value is undefined
        return True


def encode_users(values: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    """``(codes, U)``: the code ``0 .. U-1`` of the user of every row, numbered in first-seen order, and ``U``.

    ``values`` is a dataset column naming the user of every row (any hashable values: ``str``, ``int``...). Values
    equal in Python (``1``, ``1.0``, ``numpy.int64(1)``) name one user.

    Raises:
        ValueError: a missing value (``None``, NaN): a row with no user would be a unit the sampler does not protect.
        TypeError: an unhashable value.
    """
    index: dict[Hashable, int] = {}
    codes = np.empty(len(values), dtype=np.int64)
    for row, value in enumerate(values):
        try:
            hash(value)
        except TypeError as error:
            raise TypeError(
                f"Row {row} names its user with an unhashable {type(value).__name__} ({value!r}): user values must be "
                "hashable (str, int...)."
            ) from error
        if _is_missing(value):
            raise ValueError(
                f"Row {row} has no user ({value!r}): with user-level DP every row must name its user, since a row "
                "without one would be a unit the sampling and clipping do not protect. Fill in or drop such rows."
            )
        codes[row] = index.setdefault(value, len(index))
    return codes, len(index)


class PoissonUserBatchSampler(_PoissonSchedule):
    """Batch sampler of users, yielding ``steps_per_epoch * num_micro_batches`` lists of row indices per epoch.

    Args:
        user_ids (`Sequence[int]`): for every row of the training set, its user's code in ``[0, num_users)`` (see
            :func:`encode_users`); the rows of one user need not be contiguous.
        sample_rate (`float`): ``q`` in (0, 1], over users.
        num_micro_batches (`int`): micro-batches per logical batch (``gradient_accumulation_steps``).
        steps_per_epoch (`int`, *optional*): logical batches per epoch; defaults to ``max(1, floor(1 / q))``.
        max_examples_per_user (`int`): ``k >= 1``, the most rows of one user in a logical batch.
        seed (`int`, *optional*, defaults to 0): base seed; logical batch ``k`` uses ``(seed, k)``. Keep it secret.
        draw_offset (`int`, *optional*, defaults to 0): index of the first logical batch of epoch 0.
        secure (`bool`, *optional*, defaults to `False`): draw inclusions and row subsets from SHAKE-256 keyed by
            ``seed`` (cryptographic).
        num_replicas (`int`, *optional*, defaults to 1): number of processes sharing each logical batch.
        rank (`int`, *optional*, defaults to 0): this process's share.
        num_users (`int`, *optional*): ``U``; defaults to ``max(user_ids) + 1``. A code in ``[0, U)`` with no row is
            allowed (such a user is drawn like any other and contributes nothing); pass ``U`` explicitly only when the
            set of users is known to be larger than the codes seen (for ``q = L / U`` the accounting counts ``U``).

    Attributes:
        num_users (`int`), num_rows (`int`), row_counts (`np.ndarray`, rows of every user), max_examples_per_user.
    """

    def __init__(
        self,
        user_ids: Sequence[int],
        sample_rate: float,
        num_micro_batches: int,
        steps_per_epoch: int | None = None,
        *,
        max_examples_per_user: int,
        seed: int = 0,
        draw_offset: int = 0,
        secure: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        num_users: int | None = None,
    ) -> None:
        codes = np.asarray(user_ids)
        if codes.ndim != 1 or codes.size == 0:
            raise ValueError(f"`user_ids` must be a non-empty sequence of user codes, got shape {codes.shape}.")
        if codes.dtype.kind not in "iu":
            raise TypeError(
                f"`user_ids` must hold integer user codes in [0, num_users), got dtype {codes.dtype}: map a column of "
                "user values to codes with `hf_dp.sampling.users.encode_users`."
            )
        if codes.min() < 0:
            raise ValueError(f"`user_ids` must be >= 0, got {codes.min()}.")
        self._init_schedule(
            sample_rate, num_micro_batches, steps_per_epoch, seed, draw_offset, secure, num_replicas, rank
        )
        k = max_examples_per_user
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"`max_examples_per_user` must be an integer >= 1, got {k!r}.")
        seen = int(codes.max()) + 1
        if num_users is None:
            num_users = seen
        elif isinstance(num_users, bool) or not isinstance(num_users, numbers.Integral) or num_users < seen:
            raise ValueError(f"`num_users` must be an integer >= max(user_ids) + 1 = {seen}, got {num_users!r}.")
        self.user_ids = codes.astype(np.int64)
        self.num_rows = len(codes)
        self.num_users = int(num_users)
        self.max_examples_per_user = int(k)
        self.row_counts = np.bincount(self.user_ids, minlength=self.num_users)
        # The rows of user u are _order[_starts[u]:_starts[u + 1]], in increasing row order.
        self._order = np.argsort(self.user_ids, kind="stable")
        self._starts = np.concatenate([[0], np.cumsum(self.row_counts)])

    def __repr__(self) -> str:  # never show the seed
        return (
            f"PoissonUserBatchSampler(num_users={self.num_users}, num_rows={self.num_rows}, "
            f"sample_rate={self.sample_rate}, max_examples_per_user={self.max_examples_per_user}, "
            f"num_micro_batches={self.num_micro_batches}, steps_per_epoch={self.steps_per_epoch})"
        )

    # ------------------------------------------------------------------ streams
    def _inclusion_uniforms(self, draw: int) -> np.ndarray:
        """One uniform per user; user ``u`` is in logical batch ``draw`` when its uniform is below ``q``."""
        return _uniforms(self.seed, draw, self.num_users, self.secure)

    def _row_keys(self, draw: int) -> np.ndarray:
        """One random key per row of the training set for logical batch ``draw`` (the stream of the row subsets)."""
        if self.secure:
            stream = hashlib.shake_256(f"{self.seed}:{draw}:rows".encode()).digest(8 * self.num_rows)
            return np.frombuffer(stream, dtype=np.uint64)
        child = np.random.SeedSequence([self.seed, draw], spawn_key=(0,))  # SeedSequence([seed, draw]).spawn(1)[0]
        return np.random.default_rng(child).random(self.num_rows)

    # ------------------------------------------------------------------ draws
    def rows_of(self, user: int) -> np.ndarray:
        """Every row of ``user``, in increasing order."""
        return self._order[self._starts[user] : self._starts[user + 1]]

    def contributions(self, draw: int, users: Sequence[int]) -> list[np.ndarray]:
        """The rows each of ``users`` contributes to logical batch ``draw``, in increasing order.

        All its rows when it has at most ``k``, else the ``k`` with the smallest keys of ``draw`` (a uniformly random
        ``k``-subset, fresh at every draw).
        """
        k = self.max_examples_per_user
        keys = self._row_keys(draw) if any(self.row_counts[u] > k for u in users) else None
        picked = []
        for user in users:
            rows = self.rows_of(int(user))
            if len(rows) > k:
                rows = np.sort(rows[np.argsort(keys[rows], kind="stable")[:k]])
            picked.append(rows)
        return picked

    def logical_batches(self) -> Iterator[np.ndarray]:
        """The logical batches of the current epoch: the sampled user codes of each draw (over all ranks)."""
        for draw in self._draws():
            yield np.flatnonzero(self._inclusion_uniforms(draw) < self.sample_rate)

    def _split(self, counts: np.ndarray) -> np.ndarray:
        """The micro-batch of each user (non-decreasing, so contiguous groups), balancing the row counts."""
        total = int(counts.sum())
        if total == 0:
            return np.zeros(len(counts), dtype=np.int64)
        middles = np.cumsum(counts) - counts / 2
        return np.minimum((middles * self.num_micro_batches / total).astype(np.int64), self.num_micro_batches - 1)

    def __iter__(self) -> Iterator[list[int]]:
        for draw, users in zip(self._draws(), self.logical_batches(), strict=True):
            share = users[self.rank :: self.num_replicas]
            parts = self.contributions(draw, share)
            micro: list[list[int]] = [[] for _ in range(self.num_micro_batches)]
            for where, rows in zip(self._split(np.array([len(p) for p in parts], dtype=np.int64)), parts, strict=True):
                micro[where].extend(rows.tolist())
            yield from micro
