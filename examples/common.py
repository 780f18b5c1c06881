"""Shared pieces of the examples: argument parsing with ``--disable_dp``, the DP report, printing epsilon, the user
column of user-level DP (``--privacy_unit user --user_column X --max_examples_per_user k``)."""

from __future__ import annotations

import json
import math
import os
import sys

from torch import nn
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

from hf_dp import DPTrainer, DPTrainingArguments

DP_FIELDS = {
    "target_epsilon",
    "noise_multiplier",
    "target_delta",
    "per_sample_max_grad_norm",
    "accountant",
    "epsilon_accountants",
    "poisson_sampling",
    "clipping_mode",
    "per_example_loss_reduction",
    "dp_loss_type",
    "loss_type",
    "noise_seed",
    "privacy_unit",
    "user_column",
    "max_examples_per_user",
    "adaptive_clipping",
    "target_unclipped_quantile",
    "clipping_norm_lr",
    "count_noise_multiplier",
}

#: Names a user column cannot have in the examples: the model inputs the preprocessing writes (and the label columns
#: the Trainer keeps), which the kept user column would overwrite or be confused with.
RESERVED_COLUMNS = {"input_ids", "attention_mask", "token_type_ids", "labels", "label", "label_ids"}


#: Defaults shared by the examples (Li et al. 2022): C = 0.1, constant learning rate, no weight decay; quiet logs;
#: micro-batches grouped by length (for DP: within each Poisson batch, which keeps the guarantee).
COMMON_DEFAULTS = (
    "--per_sample_max_grad_norm 0.1 --lr_scheduler_type constant --weight_decay 0 --save_strategy no "
    "--report_to none --logging_steps 10 --disable_tqdm true --train_sampling_strategy group_by_length"
).split()


def parse_args(dataclass_types, defaults: list[str], argv: list[str] | None = None):
    """Parse ``dataclass_types + (DPTrainingArguments,)``; with ``--disable_dp``, plain ``TrainingArguments``
    (the non-private baseline of the same script; DP-only flags are then ignored)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    disable_dp = "--disable_dp" in argv
    if disable_dp:
        argv.remove("--disable_dp")
        argv = _drop_flags(argv, DP_FIELDS)
        defaults = _drop_flags(defaults, DP_FIELDS | {"max_grad_norm"})
    elif _flag_value(argv, "privacy_unit") == "user" and _flag_value(argv, "train_sampling_strategy") is None:
        # The rows of a sampled user stay together in one micro-batch: no grouping by length (DPTrainingArguments
        # refuses it), so the examples' group_by_length default becomes random.
        defaults = [*_drop_flags(defaults, {"train_sampling_strategy"}), "--train_sampling_strategy", "random"]
    training_type = TrainingArguments if disable_dp else DPTrainingArguments
    parser = HfArgumentParser((*dataclass_types, training_type))
    parsed = parser.parse_args_into_dataclasses(defaults + argv)
    return (*parsed, disable_dp)


def _flag_value(argv: list[str], name: str) -> str | None:
    """The value of the last ``--name value`` / ``--name=value`` in ``argv``, or None."""
    value = None
    for i, token in enumerate(argv):
        if token == f"--{name}":
            value = argv[i + 1] if i + 1 < len(argv) else ""
        elif token.startswith(f"--{name}="):
            value = token.split("=", 1)[1]
    return value


def _drop_flags(argv: list[str], names: set[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip and not token.startswith("--"):
            continue
        skip = False
        if token.startswith("--") and token[2:].split("=")[0] in names:
            skip = "=" not in token
            continue
        out.append(token)
    return out


def user_column(args: TrainingArguments) -> str | None:
    """The training set's user column under user-level DP (``--privacy_unit user``); None otherwise (example-level
    DP, and the ``--disable_dp`` baseline, which has no unit of privacy)."""
    return args.user_column if getattr(args, "privacy_unit", "example") == "user" else None


def check_user_column(column: str, available, source: str, derived: dict[str, str] | None = None) -> None:
    """Fail early, before any model is built, when ``--user_column`` is not among the training data's columns (or the
    example's ``derived`` ones, name -> meaning), naming what there is."""
    if column in RESERVED_COLUMNS:
        raise ValueError(
            f"--user_column {column!r}: that name is a model input or label column of this example; rename the "
            "column that names each row's user."
        )
    if column in available or (derived and column in derived):
        return
    extra = "".join(f"; or derived: {name!r} ({meaning})" for name, meaning in (derived or {}).items())
    raise ValueError(
        f"--user_column {column!r} is not a column of the training data ({source}). Available columns: "
        f"{sorted(available)}{extra}. With --privacy_unit user, name the column that identifies each row's user."
    )


class WithoutColumns:
    """Calls ``collator`` on the features without ``names``: the user column, which DPTrainer reads for sampling and
    clipping but which is no model input (with ``--remove_unused_columns false`` it would reach the collator)."""

    def __init__(self, collator, names):
        self.collator = collator
        self.names = set(names)

    def __call__(self, features):
        return self.collator([{k: v for k, v in f.items() if k not in self.names} for f in features])


def add_lora(model, r: int, alpha: int, target_modules: str | None, task_type: str | None = None):
    """Wrap ``model`` with PEFT LoRA adapters of rank ``r`` (dropout 0): only the adapters (and the task head that
    peft keeps trainable for ``task_type``, e.g. the classifier for ``SEQ_CLS``) train; the base weights are frozen.

    ``target_modules`` is a comma list, or None for peft's default modules for this model type.
    """
    from peft import LoraConfig, get_peft_model

    targets = target_modules.split(",") if target_modules else None
    is_gpt2 = getattr(model.config, "model_type", "") == "gpt2"  # GPT-2's Conv1D stores weights fan-in first
    config = LoraConfig(
        task_type=task_type,
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        fan_in_fan_out=is_gpt2,
        lora_dropout=0.0,
    )
    return get_peft_model(model, config)


def trainable_parameters(model: nn.Module) -> int:
    """How many parameter entries the optimizer (and, under DP, the noise) covers."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_trainer(disable_dp: bool, **kwargs) -> Trainer:
    if disable_dp:
        kwargs.pop("compute_loss_func_dp", None)
        return Trainer(**kwargs)
    loss_func = kwargs.pop("compute_loss_func_dp", None)
    if loss_func is not None:
        kwargs["compute_loss_func"] = loss_func
    return DPTrainer(**kwargs)


class PrintEpsilon(TrainerCallback):
    """One short line per logging step: loss and epsilon."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and state.is_world_process_zero:
            eps = "  ".join(f"{k} {v:.3f}" for k, v in logs.items() if k.startswith("epsilon"))
            if "clip_norm" in logs:  # adaptive clipping: the C of the next step
                eps += f"  C {logs['clip_norm']:.4g}"
            print(f"step {state.global_step}/{state.max_steps}  loss {logs['loss']:.4f}  {eps}", flush=True)


def privacy_report(trainer: Trainer) -> dict:
    if not isinstance(trainer, DPTrainer):
        return {"private": False}
    args = trainer.args
    plan = trainer.dp_plan
    names = sorted({args.accountant, *args.epsilon_accountants})
    if plan.privacy_unit == "user":  # N, q, the expected batch and the default delta count users
        unit = {
            "unit": f"user ({plan.user_column})",
            "users": plan.num_examples,
            "rows": plan.num_rows,
            "max_examples_per_user": plan.max_examples_per_user,
        }
    else:
        unit = {"unit": "example"}
    adaptive = {}
    if plan.adaptive_clipping:  # each step's C comes from noised counts only: covered by the guarantee
        norms = list(trainer.dp_callback.clip_norms)
        adaptive = {"adaptive_clipping": True, "clip_norms": norms, "clip_norm": trainer.dp_callback.next_clip_norm}
    return {
        "private": True,
        **unit,
        "epsilon": {name: trainer.epsilon(name) for name in names},
        "accountant": args.accountant,
        "delta": trainer.delta,
        "noise_multiplier": trainer.dp_noise_multiplier,
        "sample_rate": trainer.sample_rate,
        "steps": trainer.dp_callback.steps,
        "expected_batch_size": trainer.expected_batch_size,
        "per_sample_max_grad_norm": args.per_sample_max_grad_norm,
        "noise_mechanism": plan.noise_mechanism,
        "noise_bands": plan.noise_bands,
        **adaptive,
    }


def write_report(output_dir: str, report: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=2, default=lambda x: None if isinstance(x, float) and math.isinf(x) else str(x))
    privacy = report.get("privacy", {})
    lines = ["", "== report =="]
    if privacy.get("private"):
        eps = ", ".join(f"{k} {v:.3f}" for k, v in privacy["epsilon"].items())
        lines.append(
            f"epsilon ({eps}), delta {privacy['delta']:.2g}, sigma {privacy['noise_multiplier']:.4f}, "
            f"steps {privacy['steps']}, q {privacy['sample_rate']:.4g}"
        )
        if privacy.get("users") is not None:
            lines.append(
                f"privacy unit: {privacy['unit']}, {privacy['users']} users ({privacy['rows']} rows), at most "
                f"{privacy['max_examples_per_user']} rows per user in a batch"
            )
        else:
            lines.append(f"privacy unit: {privacy.get('unit', 'example')}")
        if privacy.get("adaptive_clipping") and privacy.get("clip_norm") is not None:
            lines.append(f"adaptive clipping: C {privacy['per_sample_max_grad_norm']:g} -> {privacy['clip_norm']:.4g}")
    else:
        lines.append("non-private (--disable_dp)")
    lines += [f"{k}: {v}" for k, v in report.get("metrics", {}).items()]
    print("\n".join(lines), flush=True)


def end_distributed() -> None:
    """Tear down the process group that ``torchrun`` / ``accelerate launch`` started, after training.

    With the gloo backend a group still alive at interpreter exit can abort the process (SIGABRT, "terminate called
    without an active exception") after everything was saved; PyTorch asks scripts to destroy it themselves.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
