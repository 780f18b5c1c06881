"""What may leave the process: the one filter every file DPTrainer writes passes through (DESIGN §4 rule 15).

The guarantee covers the noised model and what is computed from it. Un-noised statistics of the training data (the
training loss, token counts, FLOs, the run time and throughput, which depend on the sizes of the Poisson batches) are
not covered: they stay local (console, progress bar, ``report_to`` on the user's machine) and are dropped from
everything that is written to disk or pushed (``trainer_state.json`` in checkpoints and ``output_dir``, the
``*_results.json`` of ``save_metrics``, the model card's results table) unless the user opts in with
``publish_training_metrics=True``, and then the card says what was published.

It is an allowlist: a log key is released only if it is known to be noised or public. Evaluation metrics
(``eval_*``, ``test_*``, ``predict_*``) are computed on the data given for evaluation, the user's business; the card
says that the guarantee does not cover them. When the trainer's ``eval_dataset`` is the training set (or a substantial
part of it: :mod:`hf_dp.release.eval_overlap`), its metrics are un-noised statistics of the training data: they are
withheld from every written file like the training loss (the ``withheld`` prefixes, e.g. ``eval_``; kept in memory,
in ``trainer.state.log_history`` and what ``evaluate()`` returns), unless ``publish_training_metrics=True``, and the
card says what was withheld. Selection on such metrics (``load_best_model_at_end``, early stopping, plateau schedules)
is refused before training.

Every folder that receives weights gets the DP card of that moment: ``save_model`` writes it (checkpoints included),
and the ``hub_strategy`` uploads (every_save, checkpoint, all_checkpoints) write it into ``output_dir`` before the
Trainer uploads it. The ``differential-privacy`` tag is set only there, with the section that states the guarantee; a
run without one (noise multiplier 0, epsilon infinite) is tagged ``no-dp-guarantee`` instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from transformers import TrainerState

__all__ = [
    "ReleasedTrainerState",
    "is_released_log_key",
    "release_state",
    "released_log_history",
    "released_metrics",
    "unreleased_log_keys",
]

#: Log keys that are public or computed from noised releases only (``clip_norm``: adaptive clipping's C, set from
#: the noised counts).
RELEASED_LOG_KEYS = frozenset({"epoch", "step", "learning_rate", "grad_norm", "epsilon", "clip_norm"})
#: Prefixes of released keys: epsilon per accountant, and metrics on evaluation data (not covered; the card says so).
RELEASED_LOG_PREFIXES = ("epsilon_", "eval_", "test_", "predict_")
#: TrainerState fields that count the training data; zeroed in released files.
UNRELEASED_STATE_FIELDS = ("total_flos", "num_input_tokens_seen")


def is_released_log_key(key: str, withheld: tuple[str, ...] = ()) -> bool:
    """Whether a log key may be written to released files by default (``withheld``: prefixes of evaluation metrics
    computed on the training set, never released by default)."""
    if withheld and key.startswith(withheld):
        return False
    return key in RELEASED_LOG_KEYS or key.startswith(RELEASED_LOG_PREFIXES)


def _released_entry(entry: Mapping[str, Any], withheld: tuple[str, ...]) -> dict[str, Any] | None:
    kept = {k: v for k, v in entry.items() if is_released_log_key(k, withheld)}
    # An entry left with only its position carried nothing released.
    return kept if set(kept) - {"epoch", "step"} else None


def released_log_history(
    log_history: Iterable[Mapping[str, Any]], publish: bool = False, withheld: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """``log_history`` without un-noised training statistics (all of it when ``publish``)."""
    if publish:
        return [dict(entry) for entry in log_history]
    return [kept for entry in log_history if (kept := _released_entry(entry, withheld)) is not None]


def released_metrics(
    metrics: Mapping[str, Any], publish: bool = False, withheld: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A metrics dict (as given to ``save_metrics``) without un-noised training statistics."""
    return dict(metrics) if publish else {k: v for k, v in metrics.items() if is_released_log_key(k, withheld)}


def unreleased_log_keys(log_history: Iterable[Mapping[str, Any]], withheld: tuple[str, ...] = ()) -> list[str]:
    """The keys of ``log_history`` that are not released by default (what ``publish_training_metrics`` publishes)."""
    return sorted({k for entry in log_history for k in entry if not is_released_log_key(k, withheld)})


class ReleasedTrainerState(TrainerState):
    """A ``TrainerState`` whose ``save_to_json`` (checkpoints, ``save_state``) writes only released statistics."""

    _hf_dp_publish: bool = False  # instance attributes, not dataclass fields: never written
    _hf_dp_withheld: tuple[str, ...] = ()

    def save_to_json(self, json_path: str) -> None:
        data = dataclasses.asdict(self)
        if not self._hf_dp_publish:
            data["log_history"] = released_log_history(data.get("log_history", []), withheld=self._hf_dp_withheld)
            for name in UNRELEASED_STATE_FIELDS:
                if name in data:
                    data[name] = 0
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def release_state(state: TrainerState, publish: bool, withheld: tuple[str, ...] | None = None) -> TrainerState:
    """Make ``state`` a :class:`ReleasedTrainerState` (same object, same fields) so every save is filtered
    (``withheld``: set the withheld prefixes; `None` keeps them)."""
    if not isinstance(state, ReleasedTrainerState):
        state.__class__ = ReleasedTrainerState
    state._hf_dp_publish = publish
    if withheld is not None:
        state._hf_dp_withheld = tuple(withheld)
    return state
