"""Privacy audit: does a training run leak less than its epsilon says?

Canaries are inserted into one training run, each with probability 1/2; after training, a membership guess on each
canary gives an empirical lower bound on epsilon (Steinke, Nasr and Jagielski 2023, "Privacy Auditing with One (1)
Training Run"), and generative canaries also get their exposure (Carlini et al. 2019, "The Secret Sharer"). The
audit uses the trainer only through its public API: a training set and a callback.

```python
from hf_dp.audit import CanaryAudit, CausalLMCanaries, candidate_token_ids

audit = CanaryAudit(CausalLMCanaries(500, candidate_token_ids(tokenizer), secret_length=8, seed=1), seed=2)
trainer = DPTrainer(..., train_dataset=audit.training_set(train_dataset), callbacks=[audit.callback()])
trainer.train()
result = audit.result(claimed_epsilon=trainer.epsilon(), delta=trainer.delta)
```
"""

from .auditor import CanaryAudit
from .bounds import epsilon_lower_bound, one_run_p_value
from .callback import AuditCallback
from .canaries import (
    CanarySet,
    CausalLMCanaries,
    ClassificationCanaries,
    MaskedLMCanaries,
    candidate_token_ids,
)
from .exposures import canary_exposures, exposure
from .guesses import GuessChoice, choose_guesses, count_correct
from .losses import canary_losses
from .result import CARD_FIELDS, AuditResult
from .scores import CanaryScores

__all__ = [
    "AuditCallback",
    "AuditResult",
    "CARD_FIELDS",
    "CanaryAudit",
    "CanaryScores",
    "CanarySet",
    "CausalLMCanaries",
    "ClassificationCanaries",
    "GuessChoice",
    "MaskedLMCanaries",
    "canary_exposures",
    "canary_losses",
    "candidate_token_ids",
    "choose_guesses",
    "count_correct",
    "epsilon_lower_bound",
    "exposure",
    "one_run_p_value",
]
