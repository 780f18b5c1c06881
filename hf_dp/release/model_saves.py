"""The DP card on the routes a model leaves by without the trainer: ``model.save_pretrained`` and
``model.push_to_hub`` (plain transformers models and PEFT models, adapters included).

After ``train()``, the trainer attaches the card of that moment to its model (:func:`attach_dp_card`): two instance
attributes that shadow the class's ``save_pretrained`` and ``push_to_hub`` (small callables of this module, so that
``copy.deepcopy`` and ``torch.save`` still work; loading a pickled model then needs hf_dp importable) and the card's
text. ``save_pretrained`` then writes the "Differential privacy" section into the folder's ``README.md`` (after
PEFT's own card, which it keeps); ``push_to_hub`` uploads it in the repository's card. :func:`detach_dp_card` gives the
model its plain methods back. The forward pass, the parameters and the class are untouched: this is no hook of training.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

from torch import nn

from .model_card import write_dp_model_card

__all__ = ["attach_dp_card", "detach_dp_card", "has_dp_card"]

_CARD = "_hf_dp_card"
_METHODS = ("save_pretrained", "push_to_hub")


def attach_dp_card(model: nn.Module, section: str, tags: Sequence[str]) -> None:
    """Make ``model.save_pretrained`` and ``model.push_to_hub`` write ``section`` (the "Differential privacy" card
    section) and ``tags`` into the card of what they write (again: the latest card replaces an earlier one)."""
    if not all(hasattr(type(model), name) for name in _METHODS):
        return  # not a transformers or PEFT model: the trainer's saves carry the card
    model.__dict__[_CARD] = (section, tuple(tags))
    model.__dict__["save_pretrained"] = _WithDPCard(model, _save_pretrained)
    model.__dict__["push_to_hub"] = _WithDPCard(model, _push_to_hub)


def detach_dp_card(model: nn.Module) -> None:
    """Give ``model`` its class's ``save_pretrained`` and ``push_to_hub`` back (no DP card on them)."""
    for name in (_CARD, *_METHODS):
        model.__dict__.pop(name, None)


def has_dp_card(model: nn.Module) -> bool:
    """Whether ``model``'s own saves write the DP card."""
    return _CARD in model.__dict__


class _WithDPCard:
    """``model.save_pretrained`` / ``model.push_to_hub`` with the DP card (a plain object: it pickles and deep-copies
    with the model)."""

    def __init__(self, model: nn.Module, function) -> None:
        self.model, self.function = model, function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.model, *args, **kwargs)


def _save_pretrained(self: nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    """The class's ``save_pretrained``, then the DP section into ``save_directory/README.md``."""
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", True) and os.path.isdir(save_directory):
        section, tags = self.__dict__[_CARD]
        write_dp_model_card(str(save_directory), section, tags=list(tags))
    return result


def _push_to_hub(
    self: nn.Module,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | None = None,
) -> Any:
    """transformers' ``PushToHubMixin.push_to_hub`` with the DP section in the uploaded card.

    Maintenance note: a copy of ``PushToHubMixin.push_to_hub`` (transformers 5.x) with two changes, marked: the model is
    saved by the class's own ``save_pretrained``, and the DP section is written into the card after transformers
    created it (transformers writes the card after saving, over what ``save_pretrained`` wrote)."""
    import transformers.utils.hub as hub

    repo_id = hub.hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    card = hub.create_and_tag_model_card(repo_id, tags, token=token)
    with tempfile.TemporaryDirectory() as work_dir:
        type(self).save_pretrained(self, work_dir, max_shard_size=max_shard_size)  # changed: the class's own save
        card.save(os.path.join(work_dir, "README.md"))
        section, dp_tags = self.__dict__[_CARD]
        write_dp_model_card(work_dir, section, tags=list(dp_tags))  # changed: the DP section in the card
        return self._upload_modified_files(
            work_dir,
            repo_id,
            files_timestamps={},
            commit_message=commit_message,
            token=token,
            create_pr=create_pr,
            revision=revision,
            commit_description=commit_description,
        )
