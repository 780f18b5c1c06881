"""Canaries: examples made up for the audit, whose membership in the training set only the audit knows.

Three kinds, one per loss the trainer infers from the model class:

- `CausalLMCanaries`: a random secret of ``secret_length`` tokens, after an optional fixed prefix (a template such
  as ``"My PIN is {secret}"``); the loss is on the secret (Carlini et al. 2019, "The Secret Sharer").
- `MaskedLMCanaries`: a random key (a per-canary context) followed by a secret whose positions are masked in the
  input and labelled; the model can only lower the loss on the secret by memorising key -> secret.
- `ClassificationCanaries`: inputs with a wrong label (random sequences, or held-out examples whose true label is
  excluded), which a model can only fit by memorising them.

Every canary set gives training items (``dict`` of 1-D ``torch.long`` tensors ``input_ids``, ``attention_mask`` and
``labels``; ``labels`` is a scalar for classification), of which your collator pads the ones the audit includes.
Generative canary sets can also rebuild a canary with another secret (`with_secret`), for exposure.

Secrets are drawn from a numpy generator of their own (``seed``), independent of the inclusion bits that
`CanaryAudit` draws: a canary's content says nothing about whether it was trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "CANARY_TASKS",
    "CanarySet",
    "CausalLMCanaries",
    "ClassificationCanaries",
    "MaskedLMCanaries",
    "candidate_token_ids",
    "canary_rng",
]

IGNORE_INDEX = -100
#: The losses a canary set can be scored with (the names DPTrainer uses for its per-example losses).
CANARY_TASKS = ("causal_lm", "masked_lm", "sequence_classification")

# Stream indices of SeedSequence(seed).spawn-style keys: secrets and inclusion bits never share a stream.
_SECRET_STREAM = 1
_ALTERNATIVE_STREAM = 2
_INCLUSION_STREAM = 3
_KEY_STREAM = 4


def canary_rng(seed: int | None, stream: int) -> np.random.Generator:
    """An independent numpy generator for one use (``stream``) of the audit's ``seed`` (None: OS entropy)."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream,)))


def candidate_token_ids(tokenizer: Any) -> list[int]:
    """Token ids a random secret may use: the tokenizer's vocabulary without its special tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.

    Returns:
        `list[int]`: sorted ids.
    """
    special = set(tokenizer.all_special_ids)
    return sorted(i for i in tokenizer.get_vocab().values() if i not in special)


def _token_ids(token_ids: Sequence[int] | int, name: str = "token_ids") -> np.ndarray:
    ids = np.arange(token_ids) if isinstance(token_ids, (int, np.integer)) else np.asarray(list(token_ids))
    if ids.ndim != 1 or len(ids) < 2 or ids.dtype.kind not in "iu" or (ids < 0).any():
        raise ValueError(
            f"`{name}` must be at least 2 non-negative token ids (or a vocabulary size), got {token_ids!r}. Use "
            "`candidate_token_ids(tokenizer)` for the tokenizer's non-special tokens."
        )
    return np.unique(ids)


def _check_count(value: int, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _long(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


def _item(ids: list[int], labels: list[int]) -> dict[str, torch.Tensor]:
    return {"input_ids": _long(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long), "labels": _long(labels)}


class CanarySet:
    """Base class: ``len(canaries)`` canaries, ``canaries[i]`` the training item of canary ``i``.

    Attributes:
        task (`str`): the loss they are scored with, one of `CANARY_TASKS`.
        pad_token_id (`int`): the id used to pad them into batches.
        generative (`bool`): whether they have a secret that `with_secret` can replace (exposure).
    """

    task: str = ""
    pad_token_id: int = 0
    generative: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def group(self, i: int) -> int:
        """Canaries of the same group share everything but the secret (and so share exposure alternatives)."""
        return i

    def secret(self, i: int) -> np.ndarray:
        raise TypeError(f"{type(self).__name__} has no secrets; exposure applies to generative canaries only.")

    def random_secrets(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise TypeError(f"{type(self).__name__} has no secrets; exposure applies to generative canaries only.")

    def with_secret(self, i: int, secret: np.ndarray) -> dict[str, torch.Tensor]:
        raise TypeError(f"{type(self).__name__} has no secrets; exposure applies to generative canaries only.")


class _SecretCanaries(CanarySet):
    generative = True

    def __init__(self, num_canaries, token_ids, secret_length, seed) -> None:
        self.num_canaries = _check_count(num_canaries, "num_canaries")
        self.secret_length = _check_count(secret_length, "secret_length")
        self.token_ids = _token_ids(token_ids)
        self.secrets = canary_rng(seed, _SECRET_STREAM).choice(self.token_ids, (self.num_canaries, secret_length))

    def __len__(self) -> int:
        return self.num_canaries

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.with_secret(i, self.secrets[i])

    def secret(self, i: int) -> np.ndarray:
        return self.secrets[i]

    def random_secrets(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` secrets drawn like the canaries' own (uniform over ``token_ids^secret_length``)."""
        return rng.choice(self.token_ids, (n, self.secret_length))


class CausalLMCanaries(_SecretCanaries):
    """Random token sequences (the secret), after an optional fixed prefix; loss on the secret tokens.

    Args:
        num_canaries (`int`): how many canaries (m).
        token_ids (`Sequence[int]` or `int`): the ids secrets are drawn from (uniformly, with repetition), or a
            vocabulary size V for ``range(V)``. Leave special tokens out (`candidate_token_ids`).
        secret_length (`int`): tokens per secret.
        prefix_ids (`Sequence[int]`, *optional*): fixed tokens before the secret (a template's prefix, or a BOS
            token), not labelled. Without one, the secret's first token is context only (a causal LM never
            predicts position 0).
        pad_token_id (`int`, *optional*, defaults to 0): the id batches are padded with.
        seed (`int`, *optional*): seed of the secrets (None: OS entropy).

    Example:
        ```python
        canaries = CausalLMCanaries(500, candidate_token_ids(tokenizer), secret_length=8,
                                    prefix_ids=[tokenizer.bos_token_id], pad_token_id=tokenizer.pad_token_id, seed=0)
        canaries[0]  # {"input_ids": ..., "attention_mask": ..., "labels": ...}
        ```
    """

    task = "causal_lm"

    def __init__(
        self,
        num_canaries: int,
        token_ids: Sequence[int] | int,
        secret_length: int,
        *,
        prefix_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__(num_canaries, token_ids, secret_length, seed)
        self.prefix_ids = [int(t) for t in prefix_ids]
        self.pad_token_id = int(pad_token_id)

    @classmethod
    def from_template(
        cls,
        tokenizer: Any,
        template: str,
        num_canaries: int,
        *,
        secret_length: int,
        token_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> CausalLMCanaries:
        """Canaries ``template.format(secret=...)`` with ``{secret}`` at the end, e.g. ``"My PIN is {secret}"``.

        The prefix is tokenised once; the secret is ``secret_length`` random ids from ``token_ids`` (default: the
        tokenizer's non-special tokens), so every canary has the same prefix tokens and length.

        Raises:
            ValueError: if ``template`` does not end with ``{secret}``.
        """
        if not template.endswith("{secret}") or template.count("{secret}") != 1:
            raise ValueError(
                f"`template` must end with the one placeholder '{{secret}}' (the secret is what the model may "
                f"memorise, scored after the prefix), got {template!r}."
            )
        prefix = tokenizer(template[: -len("{secret}")], add_special_tokens=False)["input_ids"]
        if tokenizer.bos_token_id is not None:
            prefix = [tokenizer.bos_token_id, *prefix]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(
            num_canaries,
            token_ids if token_ids is not None else candidate_token_ids(tokenizer),
            secret_length,
            prefix_ids=prefix,
            pad_token_id=pad or 0,
            seed=seed,
        )

    def group(self, i: int) -> int:
        return 0  # one shared prefix: every canary's alternatives come from the same space

    def with_secret(self, i: int, secret: np.ndarray) -> dict[str, torch.Tensor]:
        ids = [*self.prefix_ids, *(int(t) for t in secret)]
        labels = [IGNORE_INDEX] * len(self.prefix_ids) + [int(t) for t in secret]
        return _item(ids, labels)


class MaskedLMCanaries(_SecretCanaries):
    """A random key of ``key_length`` tokens, then ``secret_length`` masked positions labelled with the secret.

    Input ``prefix + key + [MASK] * s + suffix``, labels ``-100`` except the secret. Your collator must keep these
    labels (pad only; do not re-mask the canaries).

    Args:
        num_canaries (`int`): how many canaries (m).
        token_ids (`Sequence[int]` or `int`): ids keys and secrets are drawn from, or a vocabulary size.
        key_length (`int`): tokens of the per-canary random key (the context the secret is memorised against).
        secret_length (`int`): masked tokens per secret.
        mask_token_id (`int`): the tokenizer's mask token.
        prefix_ids (`Sequence[int]`, *optional*): fixed tokens first (e.g. ``[CLS]``/``<s>``).
        suffix_ids (`Sequence[int]`, *optional*): fixed tokens last (e.g. ``[SEP]``/``</s>``).
        pad_token_id (`int`, *optional*, defaults to 0): the id batches are padded with.
        seed (`int`, *optional*): seed of keys and secrets (None: OS entropy).
    """

    task = "masked_lm"

    def __init__(
        self,
        num_canaries: int,
        token_ids: Sequence[int] | int,
        *,
        key_length: int,
        secret_length: int,
        mask_token_id: int,
        prefix_ids: Sequence[int] = (),
        suffix_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__(num_canaries, token_ids, secret_length, seed)
        self.key_length = _check_count(key_length, "key_length")
        self.keys = canary_rng(seed, _KEY_STREAM).choice(self.token_ids, (self.num_canaries, self.key_length))
        self.mask_token_id = int(mask_token_id)
        self.prefix_ids = [int(t) for t in prefix_ids]
        self.suffix_ids = [int(t) for t in suffix_ids]
        self.pad_token_id = int(pad_token_id)

    def with_secret(self, i: int, secret: np.ndarray) -> dict[str, torch.Tensor]:
        key = [int(t) for t in self.keys[i]]
        secret = [int(t) for t in secret]
        ids = [*self.prefix_ids, *key, *([self.mask_token_id] * len(secret)), *self.suffix_ids]
        labels = [IGNORE_INDEX] * (len(self.prefix_ids) + len(key)) + secret + [IGNORE_INDEX] * len(self.suffix_ids)
        return _item(ids, labels)


class ClassificationCanaries(CanarySet):
    """Mislabelled examples: random token sequences, or given inputs with a label other than their true one.

    Args:
        num_canaries (`int`): how many canaries (m); with ``inputs``, at most ``len(inputs)``.
        num_labels (`int`): the classifier's number of classes (>= 2).
        token_ids (`Sequence[int]` or `int`, *optional*): ids of random inputs (when ``inputs`` is None).
        length (`int`, *optional*): tokens per random input (when ``inputs`` is None).
        inputs (`Sequence[Sequence[int]]`, *optional*): tokenised held-out examples (never in the training data)
            to mislabel, e.g. ``tokenizer(texts)["input_ids"]``; the first ``num_canaries`` are used.
        true_labels (`Sequence[int]`, *optional*): their labels; each canary gets a label drawn uniformly from the
            others. Without them (random inputs), the label is uniform over all classes.
        prefix_ids (`Sequence[int]`, *optional*): fixed tokens before a random input (e.g. ``[CLS]``).
        suffix_ids (`Sequence[int]`, *optional*): fixed tokens after a random input (e.g. ``[SEP]``).
        pad_token_id (`int`, *optional*, defaults to 0): the id batches are padded with.
        seed (`int`, *optional*): seed of the inputs and labels (None: OS entropy).
    """

    task = "sequence_classification"

    def __init__(
        self,
        num_canaries: int,
        num_labels: int,
        *,
        token_ids: Sequence[int] | int | None = None,
        length: int | None = None,
        inputs: Sequence[Sequence[int]] | None = None,
        true_labels: Sequence[int] | None = None,
        prefix_ids: Sequence[int] = (),
        suffix_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        seed: int | None = None,
    ) -> None:
        self.num_canaries = _check_count(num_canaries, "num_canaries")
        self.num_labels = _check_count(num_labels, "num_labels", minimum=2)
        rng = canary_rng(seed, _SECRET_STREAM)
        if inputs is None:
            if token_ids is None or length is None:
                raise ValueError(
                    "ClassificationCanaries needs either `inputs` (held-out examples to mislabel) or `token_ids` "
                    "and `length` (random inputs)."
                )
            body = rng.choice(_token_ids(token_ids), (self.num_canaries, _check_count(length, "length")))
            self.inputs = [[*map(int, prefix_ids), *map(int, row), *map(int, suffix_ids)] for row in body]
        else:
            if len(inputs) < self.num_canaries:
                raise ValueError(f"`inputs` has {len(inputs)} examples, fewer than num_canaries={num_canaries}.")
            self.inputs = [[int(t) for t in x] for x in inputs[: self.num_canaries]]
            if any(len(x) == 0 for x in self.inputs):
                raise ValueError("Every input of `inputs` needs at least one token.")
        if true_labels is None:
            self.labels = rng.integers(0, self.num_labels, self.num_canaries)
        else:
            true = np.asarray(list(true_labels)[: self.num_canaries], dtype=np.int64)
            if len(true) < self.num_canaries or ((true < 0) | (true >= self.num_labels)).any():
                raise ValueError(
                    f"`true_labels` must give a label in [0, {self.num_labels}) for each of the {self.num_canaries} "
                    "inputs."
                )
            # A uniform label among the other num_labels - 1 classes: shift by 1..num_labels-1 (mod num_labels).
            self.labels = (true + rng.integers(1, self.num_labels, self.num_canaries)) % self.num_labels
        self.pad_token_id = int(pad_token_id)

    def __len__(self) -> int:
        return self.num_canaries

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.inputs[i]
        return {
            "input_ids": _long(ids),
            "attention_mask": torch.ones(len(ids), dtype=torch.long),
            "labels": torch.tensor(int(self.labels[i]), dtype=torch.long),
        }
