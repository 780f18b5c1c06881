"""DP contrastive preference optimisation for TRL: :class:`DPCPOTrainer` / :class:`DPCPOConfig` (CPO, SimPO and
AlphaPO: TRL's ``trl.experimental.cpo``).

TRL's ``cpo.py`` changes three names: ``CPOConfig`` -> ``DPCPOConfig``, ``CPOTrainer`` -> ``DPCPOTrainer`` and the
import. The dataset formats (standard and conversational ``prompt``/``chosen``/``rejected``, or implicit prompts), the
tokenisation, the collator, ``peft_config`` and evaluation are TRL's. CPO needs no reference model.

The unit of privacy is one preference pair, or with ``privacy_unit="user"`` every pair of one user. In a DP step the
policy runs on the chosen rows and on the rejected rows (:mod:`.pair_policy`), and the loss of pair ``i`` is

    loss_i = L(beta, z_i) + cpo_alpha * NLL_i(chosen completion),    z_i = r(l_c) - r(l_r)

with ``l_c``, ``l_r`` the policy's summed (``sigmoid``, ``hinge``) or average (``ipo``, ``simpo``) log-probabilities of
pair ``i``'s chosen and rejected completion tokens, ``r(l) = l`` (or AlphaPO's ``(1 - exp(-alpha l)) / alpha``),
``L`` TRL's loss of ``loss_type`` (``simpo``: of ``z - simpo_gamma / beta``) and ``NLL_i`` the next-token loss of the
chosen completion averaged over that pair's own tokens (TRL: over the tokens of the batch). TRL's batch loss is
``mean(L) + cpo_alpha * NLL``.

This module imports TRL (``trl.experimental``); ``import hf_dp`` does not. Install it with ``pip install 'hf_dp[trl]'``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .cpo_config import DPCPOConfig, check_cpo_fields
from .pair_policy import CPOTrainer, DPPairPolicyMixin, sequence_log_probs

__all__ = ["DPCPOTrainer"]


class DPCPOTrainer(DPPairPolicyMixin, CPOTrainer):
    """Drop-in replacement for TRL's :class:`~trl.experimental.cpo.CPOTrainer` that trains with (epsilon,
    delta)-differential privacy, the unit of privacy being one preference pair (or every pair of one user, with
    ``privacy_unit="user"``).

    Takes CPOTrainer's arguments (``model`` as a Hub id, a local path or a causal LM object; ``peft_config``; ...) with
    ``args`` a :class:`DPCPOConfig`. A model given by name is loaded as :class:`~hf_dp.DPSFTTrainer` loads it
    (``model_init_kwargs``; float32 unless they set ``dtype``).

    The loss of pair ``i`` is TRL's CPO loss of pair ``i`` alone (``loss_type`` ``sigmoid``, ``hinge``, ``ipo``,
    ``simpo``/``alphapo``, with the BC term; the module docstring), from two book-kept forward passes per micro-batch;
    never a batch mean. TRL's training metrics (``rewards/*``, ``logps/*``, ``logits/*``, ``nll_loss``) are un-noised
    statistics of the training pairs: they are not computed in DP steps. Evaluation is TRL's.

    Raises:
        ValueError: before training, for any setting that would break the guarantee.

    Example:
        ```python
        from hf_dp.trl import DPCPOConfig, DPCPOTrainer   # was: from trl.experimental.cpo import ...

        args = DPCPOConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=1.0, loss_type="simpo",
                           per_device_train_batch_size=8, gradient_accumulation_steps=32, learning_rate=1e-4)
        trainer = DPCPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", args=args, train_dataset=pairs,
                               peft_config=LoraConfig(r=16, target_modules="all-linear"))
        trainer.train()
        ```
    """

    _dp_arguments_class = DPCPOConfig
    _check_fields = staticmethod(check_cpo_fields)

    def compute_per_example_loss(self, outputs, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]``: TRL's CPO loss of each pair alone."""
        chosen_mask = inputs["chosen_labels"][:, 1:] != -100
        rejected_mask = inputs["rejected_labels"][:, 1:] != -100
        average = self.loss_type in ("ipo", "simpo")
        chosen = sequence_log_probs(outputs["chosen_logps"], chosen_mask, average)
        rejected = sequence_log_probs(outputs["rejected_logps"], rejected_mask, average)
        if self.alpha != 0.0:
            # AlphaPO's reward (1 - p^-alpha) / alpha, with p^-alpha = exp(-alpha log p) (TRL: exp(log p).pow(-alpha))
            chosen = -torch.expm1(-self.alpha * chosen) / self.alpha
            rejected = -torch.expm1(-self.alpha * rejected) / self.alpha
        loss = self._pair_loss(chosen - rejected)
        if self.cpo_alpha != 0:
            average_nll = self.args.per_example_loss_reduction != "sum"
            loss = loss - self.cpo_alpha * sequence_log_probs(outputs["chosen_logps"], chosen_mask, average_nll)
        return loss

    def _pair_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """TRL's CPO loss of ``loss_type`` of each pair's reward difference."""
        beta, smoothing = self.beta, self.label_smoothing
        if self.loss_type == "simpo":
            logits = logits - self.simpo_gamma / beta
        if self.loss_type in ("sigmoid", "simpo"):
            return -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        if self.loss_type == "hinge":
            return torch.relu(1 - beta * logits)
        if self.loss_type == "ipo":
            return (logits - 1 / (2 * beta)) ** 2
        raise ValueError(f"Loss type {self.loss_type!r} is not computed per pair by DPCPOTrainer.")
