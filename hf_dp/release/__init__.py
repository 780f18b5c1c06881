"""Release: everything that leaves the process. Only noised or public quantities are written or pushed by default.

* :mod:`.filter`: the allowlist every written log, state and metrics file passes (DESIGN §4 rule 15);
* :mod:`.card_data`, :mod:`.model_card`: what the "Differential privacy" card section states, and its rendering from
  the template in ``templates/``;
* :mod:`.epsilon_plot`: epsilon against the step, next to the card;
* :mod:`.eval_overlap`: evaluation sets that are or overlap the training set (refused for selection, said on the card);
* :mod:`.publisher`: what a DP trainer writes when it saves or pushes (the trainers' save and card hooks delegate here).
"""

from .filter import (
    ReleasedTrainerState,
    is_released_log_key,
    release_state,
    released_log_history,
    released_metrics,
    unreleased_log_keys,
)
from .model_card import DPModelCardData, card_tags, format_bound, render_dp_section, write_dp_model_card

__all__ = [
    "DPModelCardData",
    "ReleasedTrainerState",
    "card_tags",
    "format_bound",
    "is_released_log_key",
    "release_state",
    "released_log_history",
    "released_metrics",
    "render_dp_section",
    "unreleased_log_keys",
    "write_dp_model_card",
]
