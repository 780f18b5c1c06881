"""The privacy ledger of a run: an append-only, hash-chained record of every noisy step (DESIGN §6 rule 21, §7 rule 22).

Checkpoints are not a safe record of the privacy spent: ``save_total_limit`` deletes them, ``load_best_model_at_end``
with ``save_total_limit=1`` keeps only the best (an earlier one), a crash before the first checkpoint leaves none. So
every noisy step is also appended to ``output_dir/dp_ledger.jsonl`` (outside the ``checkpoint-*`` folders) where the
noise is added, before the optimizer applies it, one JSON line per batch of steps written together::

    {"format": 2, "run": "3f2a...", "step": 12, "steps": 1, "noise_multiplier": 1.0, "sample_rate": 0.01,
     "max_grad_norm": 0.1, "delta": 1e-05, "accountant": "rdp", "unit": "example", "max_examples_per_user": null,
     "mechanism": "dp-sgd", "bands": 1, "num_examples": 1000, "data": "9b1c...", "prev": "5e0d...", "hash": "a41f..."}

``run`` identifies the run (random, drawn at its first ``train()``, saved with its checkpoints, kept by a resume);
``step`` is the index of the first noisy step of the line in that run (0-based, over every ``train()`` call and
resume), ``steps`` how many consecutive steps with these settings the line records (C is the step's own under
adaptive clipping). ``mechanism`` and ``bands`` name the noise (``"banded-toeplitz"``: ``sample_rate`` is then the
rate of the sampled part, and ``T`` steps account as ``ceil(T / bands)`` DP-SGD steps; read by another run as DP-SGD
steps, an over-count). ``data`` is the fingerprint of the training set (:mod:`hf_dp.ledger.fingerprint`).

**Tamper-evident.** ``hash`` is a hash of the line's other fields, ``prev`` the ``hash`` of the run's previous line
("" for its first): the lines of a run form a chain, so an edited line, a removed one or a ledger rewound to an earlier
state is detected (:func:`read_ledger`). A checkpoint saves the chain's last ``hash`` and carries a copy of the run's
lines (:meth:`PrivacyLedger.write_copy`), so it knows its history wherever it is copied, and a resume checks the
checkpoint and the ledgers against each other (:mod:`hf_dp.ledger.resume`). The chain is not keyed: it catches
accidents, lost files and edits of a single field, not a forger who recomputes every hash.

The ledger holds no seed, no generator state, no loss, no statistic of the batches, and no time stamp (the time a step
takes depends on the size of its Poisson batch, an un-noised statistic: DESIGN §4 rule 15).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "LEDGER_NAME",
    "SETTINGS_FIELDS",
    "PrivacyLedger",
    "RunChain",
    "ledger_history",
    "new_run_id",
    "read_ledger",
    "record_hash",
    "record_link",
]

LEDGER_NAME = "dp_ledger.jsonl"
_FORMAT = 2
#: The DP settings every record states besides its steps' noise multiplier and sample rate.
SETTINGS_FIELDS = ("max_grad_norm", "delta", "accountant", "unit", "max_examples_per_user", "mechanism", "bands")
#: Fields a record has in every format (format 1 had no settings and no chain).
_STEP_FIELDS = ("run", "step", "steps", "noise_multiplier", "sample_rate")


def new_run_id() -> str:
    """A random identifier of a run (not a secret: nothing is derived from it)."""
    return uuid.uuid4().hex


def record_hash(record: Mapping[str, Any]) -> str:
    """The hash of a record: of its fields but ``hash`` (``prev`` included, which chains it to the line before)."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def record_link(record: Mapping[str, Any]) -> str:
    """What the next record of the run names as ``prev``: the record's ``hash`` (its content hash for format 1)."""
    return record.get("hash") or record_hash(record)


@dataclass
class RunChain:
    """The records of one run in one ledger file, in file order, up to the first that breaks the chain.

    Attributes:
        path (`str`): the ledger file.
        run_id (`str`): the run.
        records (`list[dict]`): the run's records that form an unbroken chain from its first line.
        lines (`list[str]`): their raw lines (copied byte for byte, so that their hashes still hold).
        problem (`str`, *optional*): why the chain stops before the file's last record of the run (an edited or a
            missing line), or `None`.
        base_steps (`int`), base_head (`str`): where the chain starts: step 0 and "" for a chain from the run's first
            step; a ledger begun at a resumed checkpoint whose earlier lines were lost starts at the checkpoint's step
            and ``ledger_head`` (its first record says so with ``base_steps``).
    """

    path: str
    run_id: str
    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    problem: str | None = None
    base_steps: int = 0
    base_head: str = ""

    @property
    def head(self) -> str:
        """The ``hash`` of the chain's last record (its base for a chain without records)."""
        return record_link(self.records[-1]) if self.records else self.base_head

    @property
    def steps(self) -> int:
        """Noisy steps the chain accounts (its base included)."""
        return self.base_steps + sum(int(r["steps"]) for r in self.records)

    def per_step(self) -> dict[int, dict[str, Any]]:
        """The record of every step the chain holds, by step index, with ``line`` (its line in :attr:`path`)."""
        out: dict[int, dict[str, Any]] = {}
        for record in self.records:
            for index in range(int(record["step"]), int(record["step"]) + int(record["steps"])):
                out[index] = record
        return out

    def steps_up_to(self, head: str) -> int | None:
        """The number of steps up to and including the record whose hash is ``head``, `None` if the chain has no
        such record (nor base)."""
        if head == self.base_head:
            return self.base_steps
        total = self.base_steps
        for record in self.records:
            total += int(record["steps"])
            if record_link(record) == head:
                return total
        return None

    def history_after(self, start: int) -> list[list[float]]:
        """The ``[sigma, q, steps]`` segments of the steps from ``start`` on (``start >= base_steps``)."""
        steps = self.per_step()
        return _segments(
            (float(steps[i]["noise_multiplier"]), float(steps[i]["sample_rate"]), 1) for i in range(start, self.steps)
        )

    def history(self) -> list[list[float]]:
        """The chain's ``[sigma, q, steps]`` segments (of the steps it holds: from its base on)."""
        return _segments((float(r["noise_multiplier"]), float(r["sample_rate"]), int(r["steps"])) for r in self.records)


def read_ledger(path: str) -> dict[str, RunChain]:
    """The chain of every run recorded in the ledger file ``path`` (``{}`` if the file does not exist). A line that
    is not a record (a torn last line, left by a crash during a write) is skipped with a warning; a record that does
    not continue its run's chain (edited, or after a removed line) is skipped, and the chain's ``problem`` says so:
    later records that do continue it (lines restored from a checkpoint's copy) still count."""
    chains: dict[str, RunChain] = {}
    if not os.path.isfile(path):
        return chains
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            record = _parse(line, path, number)
            if record is None:
                continue
            chain = chains.setdefault(record["run"], RunChain(path, record["run"]))
            problem = _extend(chain, record, line if line.endswith("\n") else line + "\n", number)
            chain.problem = chain.problem or problem
    return chains


def _parse(line: str, path: str, number: int) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
        if not isinstance(record, dict) or any(k not in record for k in _STEP_FIELDS):
            raise ValueError
        int(record["step"]), int(record["steps"]), float(record["noise_multiplier"]), float(record["sample_rate"])
    except (ValueError, TypeError):
        logger.warning("hf_dp: skipping unreadable line %d of the privacy ledger %s.", number, path)
        return None
    return record


def _extend(chain: RunChain, record: dict[str, Any], line: str, number: int) -> str | None:
    """Append ``record`` to ``chain`` if it continues it; else return why not (the record is skipped)."""
    base = record.get("base_steps")
    if base is not None and int(base) >= chain.steps and (not chain.records or record.get("prev") != chain.head):
        # a ledger begun (again) at a resumed checkpoint beyond the steps it held: the chain starts there
        chain.records, chain.lines = [], []
        chain.base_steps, chain.base_head = int(base), str(record.get("prev", ""))
    if record.get("format", 1) >= 2:
        if record.get("hash") != record_hash(record):
            return f"line {number} of {chain.path} was edited (its hash does not match its content)"
        if record.get("prev") != chain.head:
            return (
                f"line {number} of {chain.path} does not follow the run's previous line (a line before it was removed, "
                "or the ledger was put together from several files)"
            )
    if int(record["step"]) != chain.steps:
        return f"line {number} of {chain.path} records step {record['step']}, where step {chain.steps} was next"
    chain.records.append(record)
    chain.lines.append(line)
    return None


def _segments(steps: Iterable[tuple[float, float, int]]) -> list[list[float]]:
    history: list[list[float]] = []
    for sigma, q, n in steps:
        if history and (history[-1][0], history[-1][1]) == (sigma, q):
            history[-1][2] += n
        else:
            history.append([sigma, q, n])
    return history


def ledger_history(paths: Iterable[str], run_id: str) -> list[list[float]]:
    """The ``[sigma, q, steps]`` history of run ``run_id``: the longest unbroken chain of it among the ledgers at
    ``paths`` (missing files skipped)."""
    chains = [read_ledger(p).get(run_id) for p in dict.fromkeys(os.path.abspath(p) for p in paths)]
    longest = max((c for c in chains if c is not None), key=lambda c: c.steps, default=None)
    return longest.history() if longest is not None else []


class PrivacyLedger:
    """Appends the noisy steps of one run to ``<output_dir>/dp_ledger.jsonl``, as a hash chain.

    :meth:`record` buffers a step, :meth:`flush` appends the buffered steps (one line per run of equal settings).
    :class:`~hf_dp.DPCallback` flushes every step as it records it, i.e. where the noise is added, before the optimizer
    applies it: so no model that is saved, logged, evaluated or pushed (which all happen after the optimizer step) can
    come from a step the ledger lacks, and a crash at any point loses at most steps that no model outside the process
    depends on (a step recorded but never applied is counted: that errs on the safe side). The cost is one small append
    per optimizer step (the file is opened, appended and closed each time), ``fsync``-ed at saves and at the end of
    training; the run's lines are also kept in memory (about 300 bytes a line), for the copy each checkpoint carries.

    Args:
        output_dir (`str`): the folder of the ledger file.
        run_id (`str`): the run.
        data (`Mapping`): the training set's fingerprint (``num_examples``, ``rows`` or ``datasets``).
        settings (`Mapping`, *optional*): the values of :data:`SETTINGS_FIELDS` every record states (C: the default of
            steps recorded without their own).
        chain (`RunChain`, *optional*): the run's verified records so far (a resume, or an earlier ``train()`` call):
            new records continue its chain.
        base (`tuple[int, str]`, *optional*): without a chain, where the run's chain stands: its steps and last hash
            (a checkpoint's ``ledger_head`` whose ledger lines were lost); the first new record names it.
    """

    def __init__(
        self,
        output_dir: str,
        run_id: str,
        data: Mapping[str, Any],
        settings: Mapping[str, Any] | None = None,
        chain: RunChain | None = None,
        base: tuple[int, str] | None = None,
    ) -> None:
        self.path = os.path.join(output_dir, LEDGER_NAME)
        self.run_id = run_id
        self.num_examples = data.get("num_examples")
        self.data = data.get("rows") or data.get("datasets")
        self.settings = {name: (settings or {}).get(name) for name in SETTINGS_FIELDS}
        self.head = chain.head if chain is not None else (base[1] if base else "")
        self.lines: list[str] = list(chain.lines) if chain is not None else []
        self._base = None if chain is not None or not base or base[0] == 0 else int(base[0])
        self._pending: list[list[Any]] = []  # [first step, steps, sigma, q, C]
        self._tail_checked = False

    def __repr__(self) -> str:
        return f"PrivacyLedger({self.path!r}, run={self.run_id!r}, pending={sum(int(p[1]) for p in self._pending)})"

    def record(
        self, step: int, noise_multiplier: float, sample_rate: float, max_grad_norm: float | None = None
    ) -> None:
        """Noisy step ``step`` (0-based, in the run) with this sigma, q and C (default: the ledger's settings')."""
        clip = float(max_grad_norm) if max_grad_norm is not None else self.settings["max_grad_norm"]
        key = (float(noise_multiplier), float(sample_rate), clip)
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] + last[1] == step and tuple(last[2:]) == key:
            last[1] += 1
        else:
            self._pending.append([int(step), 1, *key])

    def flush(self, *, sync: bool = False) -> None:
        """Append the buffered steps (and ``fsync`` the file when ``sync``)."""
        if not self._pending:
            if sync and os.path.isfile(self.path):
                with open(self.path, "a", encoding="utf-8") as f:
                    os.fsync(f.fileno())
            return
        lines = [self._line(*pending) for pending in self._pending]
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        text = self._torn_tail_separator() + "".join(lines)
        with open(self.path, "ab") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            if sync:
                os.fsync(f.fileno())
        self.lines.extend(lines)
        self._pending.clear()

    def _torn_tail_separator(self) -> str:
        """A newline to write first when the file ends in a torn line (a crash during a write), which must not swallow
        the next record (checked at the first write of this ledger object only: its own writes end with a newline)."""
        if self._tail_checked:
            return ""
        self._tail_checked = True
        if not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return ""
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return "" if f.read(1) == b"\n" else "\n"

    def _line(self, first: int, steps: int, sigma: float, q: float, clip: float | None) -> str:
        record = {
            "format": _FORMAT,
            "run": self.run_id,
            "step": int(first),
            "steps": int(steps),
            "noise_multiplier": sigma,
            "sample_rate": q,
            **self.settings,
            "max_grad_norm": clip,
            "num_examples": self.num_examples,
            "data": self.data,
            "prev": self.head,
        }
        if self._base is not None:  # the first line of a ledger begun at a checkpoint
            record["base_steps"], self._base = self._base, None
        record["hash"] = self.head = record_hash(record)
        return json.dumps(record, sort_keys=True) + "\n"

    def write_copy(self, folder: str) -> None:
        """Write the run's lines so far into ``folder/dp_ledger.jsonl`` (a checkpoint's copy: it carries the run's
        history wherever the checkpoint goes); written to a temporary file, ``fsync``-ed, then renamed."""
        self.flush(sync=True)
        path = os.path.join(folder, LEDGER_NAME)
        if os.path.abspath(path) == os.path.abspath(self.path):
            return
        os.makedirs(folder, exist_ok=True)
        temporary = path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            f.write("".join(self.lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
