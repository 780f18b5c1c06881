"""Sample: Poisson logical batches of examples or users, cut into micro-batches, and what each micro-batch carries.

* :mod:`.poisson`: :class:`PoissonBatchSampler`, every example in a logical batch with probability q, from a secret
  seed;
* :mod:`.users`: :class:`PoissonUserBatchSampler`, every user with probability q, at most k of their rows;
* :mod:`.cyclic`: cyclic Poisson sampling (banded correlated noise): the units split into b secret parts, part
  ``t mod b`` sampled at step t;
* :mod:`.privacy_unit`: the user of every row (``privacy_unit="user"``);
* :mod:`.collators`: collation of micro-batches that may be empty, and its inverse (:func:`unpack_micro_batch`);
* :mod:`.batch_checks`: what reaches the model is what was sampled (no packing, one loss per sampled example);
* :mod:`.dataloader`: the training DataLoader built from them.
"""

from .batch_checks import NUM_EXAMPLES_KEY, MicroBatchChecks, check_collator
from .collators import EmptyBatchSafeCollator, MicroBatch, is_empty_batch, unpack_micro_batch
from .cyclic import CyclicPoissonBatchSampler, CyclicPoissonUserBatchSampler
from .dataloader import poisson_dataloader
from .poisson import PoissonBatchSampler
from .privacy_unit import UNIT_KEY, UnitTaggedDataset, user_codes
from .users import PoissonUserBatchSampler, encode_users

__all__ = [
    "NUM_EXAMPLES_KEY",
    "UNIT_KEY",
    "CyclicPoissonBatchSampler",
    "CyclicPoissonUserBatchSampler",
    "EmptyBatchSafeCollator",
    "MicroBatch",
    "MicroBatchChecks",
    "PoissonBatchSampler",
    "PoissonUserBatchSampler",
    "UnitTaggedDataset",
    "check_collator",
    "encode_users",
    "is_empty_batch",
    "poisson_dataloader",
    "unpack_micro_batch",
    "user_codes",
]
