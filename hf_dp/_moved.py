"""Module paths of hf_dp 0.1's flat layout, served from their new homes for one release.

``import hf_dp.sampler`` (or ``from hf_dp.model_card import ...``) still works and returns the module that now holds
the code (the same object, so attributes and monkeypatches agree), with a ``FutureWarning`` naming the new path. One
table here instead of a file per old path keeps the tree showing the data path. ``hf_dp.trl`` is not in it: it is a
documented path and stays a module of its own.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED_MODULES", "install_moved_module_aliases"]

#: old module path -> the module that holds its code now
MOVED_MODULES = {
    "hf_dp.adaptive_clipping": "hf_dp.step.adaptive_clipping",
    "hf_dp.adaptive_state": "hf_dp.step.adaptive_state",
    "hf_dp.batch_checks": "hf_dp.sampling.batch_checks",
    "hf_dp.callback": "hf_dp.ledger.callback",
    "hf_dp.checks": "hf_dp.plan.checks",
    "hf_dp.collators": "hf_dp.sampling.collators",
    "hf_dp.core": "hf_dp.trainers.mixin",
    "hf_dp.distributed": "hf_dp.step.distributed",
    "hf_dp.epsilon_plot": "hf_dp.release.epsilon_plot",
    "hf_dp.eval_overlap": "hf_dp.release.eval_overlap",
    "hf_dp.fsdp": "hf_dp.step.fsdp",
    "hf_dp.loss_scale": "hf_dp.step.loss_scale",
    "hf_dp.model_card": "hf_dp.release.model_card",
    "hf_dp.noise": "hf_dp.step.noise",
    "hf_dp.privacy_plan": "hf_dp.plan.privacy_plan",
    "hf_dp.privacy_unit": "hf_dp.sampling.privacy_unit",
    "hf_dp.sampler": "hf_dp.sampling.poisson",
    "hf_dp.seq2seq": "hf_dp.trainers.seq2seq",
    "hf_dp.trainer": "hf_dp.trainers.trainer",
    "hf_dp.trl_dpo": "hf_dp.trainers.dpo_trainer",
    "hf_dp.user_sampler": "hf_dp.sampling.users",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED_MODULES` and loads them as their new modules."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"`{spec.name}` moved to `{new}` (hf_dp is laid out along its data path: docs/architecture.md); the old "
            "path will be removed in a later release. Import from the new path, or the public names from `hf_dp`.",
            FutureWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The new module is already executed; it gets back its own spec (the import machinery set the old path's)."""
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


def install_moved_module_aliases() -> None:
    """Put the finder of the old paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
