"""DP odds-ratio preference optimisation for TRL: :class:`DPORPOTrainer` / :class:`DPORPOConfig` (ORPO, TRL's
``trl.experimental.orpo``).

TRL's ``orpo.py`` changes three names: ``ORPOConfig`` -> ``DPORPOConfig``, ``ORPOTrainer`` -> ``DPORPOTrainer`` and the
import. The dataset formats (standard and conversational ``prompt``/``chosen``/``rejected``, or implicit prompts), the
tokenisation, the collator, ``peft_config`` and evaluation are TRL's. ORPO needs no reference model.

The unit of privacy is one preference pair, or with ``privacy_unit="user"`` every pair of one user. In a DP step the
policy runs on the chosen rows and on the rejected rows (:mod:`.pair_policy`), and the loss of pair ``i`` is

    loss_i = NLL_i(chosen) - beta * log sigmoid(log_odds_i),
    log_odds_i = (l_c - l_r) - (log(1 - exp(l_c)) - log(1 - exp(l_r)))

with ``l_c``, ``l_r`` the policy's average log-probabilities of pair ``i``'s chosen and rejected completion tokens and
``NLL_i`` the next-token loss of its whole chosen sequence (prompt and completion, as TRL), averaged over that pair's
own tokens (TRL: over the tokens of the batch). TRL's batch loss is ``mean(NLL) - beta * mean(log sigmoid)``.

This module imports TRL (``trl.experimental``); ``import hf_dp`` does not. Install it with ``pip install 'hf_dp[trl]'``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .orpo_config import DPORPOConfig, check_orpo_fields
from .pair_policy import DPPairPolicyMixin, ORPOTrainer, sequence_log_probs

__all__ = ["DPORPOTrainer"]


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (Maechler 2012: branch at ``-log 2``; TRL's)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class DPORPOTrainer(DPPairPolicyMixin, ORPOTrainer):
    """Drop-in replacement for TRL's :class:`~trl.experimental.orpo.ORPOTrainer` that trains with (epsilon,
    delta)-differential privacy, the unit of privacy being one preference pair (or every pair of one user, with
    ``privacy_unit="user"``).

    Takes ORPOTrainer's arguments (``model`` as a Hub id, a local path or a causal LM object; ``peft_config``; ...) with
    ``args`` a :class:`DPORPOConfig`. A model given by name is loaded as :class:`~hf_dp.DPSFTTrainer` loads it
    (``model_init_kwargs``; float32 unless they set ``dtype``).

    The loss of pair ``i`` is TRL's ORPO loss of pair ``i`` alone (the module docstring), from two book-kept forward
    passes per micro-batch; never a batch mean. TRL's training metrics (``rewards/*``, ``logps/*``, ``logits/*``,
    ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``) are un-noised statistics of the training pairs: they are not
    computed in DP steps. Evaluation is TRL's (``eval_loss`` and its ``eval_*`` metrics).

    Raises:
        ValueError: before training, for any setting that would break the guarantee.

    Example:
        ```python
        from hf_dp.trl import DPORPOConfig, DPORPOTrainer   # was: from trl.experimental.orpo import ...

        args = DPORPOConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=1.0,
                            per_device_train_batch_size=8, gradient_accumulation_steps=32, learning_rate=1e-4)
        trainer = DPORPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", args=args, train_dataset=pairs,
                                peft_config=LoraConfig(r=16, target_modules="all-linear"))
        trainer.train()
        ```
    """

    _dp_arguments_class = DPORPOConfig
    _check_fields = staticmethod(check_orpo_fields)
    _chosen_sequence_logps = True

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]``: TRL's ORPO loss of each pair alone."""
        chosen_mask = inputs["chosen_labels"][:, 1:] != -100
        rejected_mask = inputs["rejected_labels"][:, 1:] != -100
        chosen = sequence_log_probs(outputs["chosen_logps"], chosen_mask, average=True)
        rejected = sequence_log_probs(outputs["rejected_logps"], rejected_mask, average=True)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        attended = inputs["chosen_attention_mask"][:, 1:] == 1
        average = self.args.per_example_loss_reduction != "sum"
        nll = -sequence_log_probs(outputs["chosen_sequence_logps"], attended, average=average)
        return nll - self.beta * F.logsigmoid(log_odds)
