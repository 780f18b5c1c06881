"""TRL trainers whose loss couples the examples of a batch: refused when :class:`DPTrainerMixin` is composed with them.

DP-SGD bounds each example's contribution to an update by clipping its own gradient; that bounds the sensitivity of
the clipped sum only if example ``i``'s gradient depends on example ``i`` alone (DESIGN §4 rule 1). These TRL
trainers compute each example's loss from statistics of other examples, so no per-example gradient exists to clip.
They are recognised by class (their name and TRL module, anywhere in the trainer's MRO: a subclass is refused too),
at construction, before TRL's ``__init__`` loads anything. Reading class names keeps TRL out of ``import hf_dp``.
"""

from __future__ import annotations

__all__ = ["COUPLED_TRL_TRAINERS", "check_trainer_class"]

_KTO = (
    "its loss compares each completion's log-ratio with a reference point, the KL term, estimated over the batch "
    "(the mismatched prompt-completion pairs of the micro-batch: `(KL_logps - ref_KL_logps).mean()`), so one "
    "example's loss depends on the other examples of the batch, and adding or removing one example changes every "
    "other example's gradient: the sum of clipped gradients no longer moves by at most C. TRL also requires "
    "sequential sampling for that estimate, which Poisson sampling (what the accountant assumes) replaces. Use "
    "instead: `DPDPOTrainer` (`from hf_dp.trl import DPDPOTrainer`) on preference pairs (each pair's loss its own: "
    "`loss_type='sigmoid'`, or `'apo_zero'`), or `DPSFTTrainer` on the desirable completions of unpaired data. "
    "(KTO's `loss_type='apo_zero_unpaired'` has no KL term, but hf_dp has not been checked against KTOTrainer's "
    "unpaired batches.)"
)
_GROUP = (
    "it generates several completions per prompt inside training and normalizes their rewards over the group of a "
    "prompt (advantage = {advantage}), so each completion's loss depends on the other "
    "completions of its prompt (and, with batch-level reward scaling, on the whole batch): there is no per-example "
    "gradient to clip. It also reuses each generated batch for several optimizer steps (`num_iterations`, "
    "`steps_per_generation`), which the Poisson-sampling accountant does not count. Use instead: `DPDPOTrainer` "
    "(`from hf_dp.trl import DPDPOTrainer`) on offline preference pairs, or `DPSFTTrainer` on completions chosen "
    "offline (rejection sampling with a model that never saw the private data). Clipping the whole group of a prompt "
    "as one unit (the prompt as the unit of privacy) would make group-normalized RL private; hf_dp does not support "
    "it yet."
)

#: TRL trainer class names -> why per-example clipping does not apply, and what to use instead.
COUPLED_TRL_TRAINERS = {
    "KTOTrainer": _KTO,
    "GRPOTrainer": _GROUP.format(advantage="reward minus the group's mean, divided by the group's standard deviation"),
    "AsyncGRPOTrainer": _GROUP.format(advantage="reward minus the group's mean, divided by its standard deviation"),
    "RLOOTrainer": _GROUP.format(advantage="reward minus the mean reward of the prompt's other completions"),
}


def check_trainer_class(cls: type) -> None:
    """Refuse ``cls`` if a TRL trainer whose loss couples examples is among its bases (:data:`COUPLED_TRL_TRAINERS`).

    Raises:
        ValueError: naming the TRL class, why per-example clipping does not apply, and what to use instead.
    """
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        reason = COUPLED_TRL_TRAINERS.get(klass.__name__)
        if reason is not None and (module == "trl" or module.startswith("trl.")):
            where = "" if klass is cls else f" (`{cls.__name__}` derives from it)"
            raise ValueError(
                f"DP training cannot run TRL's `{klass.__name__}`{where} with per-example clipping: {reason}"
            )
