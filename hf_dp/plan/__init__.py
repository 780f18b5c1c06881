"""The plan: a run's privacy settings, resolved once at ``train()`` start into a frozen :class:`DPPlan`, and every
refusal that can be made before the first step.

* :mod:`.privacy_plan`: :func:`resolve_plan` (sigma calibrated against the privacy already spent, q, L, delta) and
  the frozen :class:`DPPlan` the clipper, the noise, the accountant and the card all read;
* :mod:`.checks`: settings, models and trainers refused before training, each with what to do instead;
* :mod:`.report`: the plan on the console and in ``dp_summary()``.
"""

from .checks import check_before_init, check_train_dataset, check_train_start, dp_arguments
from .privacy_plan import DPPlan, FrozenSettingsError, resolve_plan

__all__ = [
    "DPPlan",
    "FrozenSettingsError",
    "check_before_init",
    "check_train_dataset",
    "check_train_start",
    "dp_arguments",
    "resolve_plan",
]
