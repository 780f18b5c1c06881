"""How :class:`~hf_dp.trainers.mixin.DPTrainerMixin` sits on any ``Trainer`` subclass: the arguments of its
constructor, read and completed by name against the signature of the class it sits on.

``class DPXTrainer(DPTrainerMixin, XTrainer)`` takes ``XTrainer``'s arguments, positional or keyword, in ``XTrainer``'s
own order (TRL's ``DPOTrainer(model, ref_model, args, ...)``, sentence-transformers' ``loss=``, GRPO's
``reward_funcs=``): the mixin reads the few it needs by name (``args``, ``model``, ``train_dataset``,
``data_collator``, ``callbacks``, ``model_init``, ``optimizers``), completes them (the DP arguments checked, the
``DPCallback`` added, ``model_init`` refused) and passes every argument on, unknown ones included.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["InitArguments", "next_init"]


def next_init(cls: type, after: type) -> Callable[..., None]:
    """The ``__init__`` that ``super().__init__`` reaches from ``after`` in ``cls``'s MRO."""
    mro = cls.__mro__
    for klass in mro[mro.index(after) + 1 :]:
        if "__init__" in vars(klass):
            return vars(klass)["__init__"]
    return object.__init__


class InitArguments:
    """The arguments of one call of ``init`` (an ``__init__``: its first parameter is ``self``), by name; names the
    signature does not declare go to its ``**kwargs`` when it has one.

    Raises:
        TypeError: the arguments do not fit ``init``'s signature (what ``init`` itself would raise).
    """

    def __init__(self, init: Callable[..., None], args: tuple, kwargs: dict[str, Any]) -> None:
        self.signature = inspect.signature(init)
        parameters = list(self.signature.parameters.values())
        self._named = {p.name for p in parameters[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        self._var_keyword = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
        self.bound = self.signature.bind_partial(None, *args, **kwargs)

    def accepts(self, name: str) -> bool:
        """Whether ``init`` takes an argument ``name`` (declared, or through ``**kwargs``)."""
        return name in self._named or self._var_keyword is not None

    def get(self, name: str, default: Any = None) -> Any:
        if name in self._named:
            return self.bound.arguments.get(name, default)
        return self._extra().get(name, default)

    def set(self, name: str, value: Any) -> None:
        """Set ``name``; an argument ``init`` does not take is dropped (the caller checks :meth:`accepts`)."""
        if name in self._named:
            self.bound.arguments[name] = value
        elif self._var_keyword is not None:
            self.bound.arguments.setdefault(self._var_keyword, {})[name] = value

    def pop(self, name: str, default: Any = None) -> Any:
        if name in self._named:
            return self.bound.arguments.pop(name, default)
        return self._extra().pop(name, default)

    def call(self, function: Callable[..., None]) -> None:
        """``function(*args, **kwargs)`` with the arguments as they are now (without ``self``)."""
        function(*self.bound.args[1:], **self.bound.kwargs)

    def _extra(self) -> dict[str, Any]:
        if self._var_keyword is None:
            return {}
        return self.bound.arguments.setdefault(self._var_keyword, {})
