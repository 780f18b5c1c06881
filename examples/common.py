"""Shared pieces of the examples: argument parsing with ``--disable_dp``, the DP report, printing epsilon."""

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
}


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
    training_type = TrainingArguments if disable_dp else DPTrainingArguments
    parser = HfArgumentParser((*dataclass_types, training_type))
    parsed = parser.parse_args_into_dataclasses(defaults + argv)
    return (*parsed, disable_dp)


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
            print(f"step {state.global_step}/{state.max_steps}  loss {logs['loss']:.4f}  {eps}", flush=True)


def privacy_report(trainer: Trainer) -> dict:
    if not isinstance(trainer, DPTrainer):
        return {"private": False}
    args = trainer.args
    names = sorted({args.accountant, *args.epsilon_accountants})
    return {
        "private": True,
        "epsilon": {name: trainer.epsilon(name) for name in names},
        "accountant": args.accountant,
        "delta": trainer.delta,
        "noise_multiplier": trainer.dp_noise_multiplier,
        "sample_rate": trainer.sample_rate,
        "steps": trainer.dp_callback.steps,
        "expected_batch_size": trainer.expected_batch_size,
        "per_sample_max_grad_norm": args.per_sample_max_grad_norm,
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
