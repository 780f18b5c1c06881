"""PEFT prefix tuning.

``PrefixEncoder`` is an ``nn.Embedding`` over the virtual-token ids (optionally followed by a two-layer MLP of
``nn.Linear``), and peft feeds it ids already expanded to the batch, ``[B, num_virtual_tokens]``. Its parameters
are therefore covered by :mod:`.embedding` and :mod:`.linear`, with one caveat checked here: the per-example
gradient of the prefix is only the book-kept one if every example gets its own row of ids. That holds for peft's
``get_prompt``; a prefix computed once and broadcast to the batch would be rejected by the engine's batch check.
"""

from __future__ import annotations

from torch import nn

from .base import UnsupportedModuleError

try:
    from peft.tuners.prefix_tuning.model import PrefixEncoder
except ImportError:
    PrefixEncoder = None


def check_prefix_encoder(module: nn.Module, name: str) -> None:
    """Reject prefix encoders whose trainable embedding could be shared across examples by construction."""
    if PrefixEncoder is None or not isinstance(module, PrefixEncoder):
        return
    embedding = getattr(module, "embedding", None)
    if not isinstance(embedding, nn.Embedding):
        raise UnsupportedModuleError(
            f"Prefix encoder `{name}` ({type(module).__name__}) has no `nn.Embedding`; hf_dp supports peft's "
            "PrefixEncoder only."
        )
