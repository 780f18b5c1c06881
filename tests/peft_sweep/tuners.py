"""The PEFT tuners of the sweep: one tiny configuration per tuner (every ``PeftType`` of peft 0.21.2, plus LoRA
variants), and the four tiny float64 base models with the modules each tuner targets on them.

A tuner entry is ``build(spec, base, tmp) -> (config, forward_kwargs)``: the peft config for one model (``base``, the
float64 base model, which a builder may adjust as the tuner requires), and the extra
keyword arguments its forward needs (a callable value is called with the batch): ``task_ids`` for Poly and multitask
prompt tuning, ``labels=None`` for CPT.
``tmp`` is a scratch folder (X-LoRA loads its LoRA experts from disk). The sizes are chosen, from each tuner's
``config.py`` and ``layer.py``, to fit the models' widths (hidden 16, feed-forward 24, GQA value width 8): block sizes,
group sizes and vector lengths divide every targeted width.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import peft
import torch
from helpers.models import (
    bert_classifier,
    causal_batches,
    classification_batches,
    gpt2,
    llama,
    seq2seq_batches,
    t5,
)


@dataclass(frozen=True)
class ModelSpec:
    """One base model and the modules the tuners target on it."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], dict]
    task_type: str  # peft's TaskType value
    linear: tuple[str, ...]  # the projections most tuners adapt (attention and feed-forward)
    ff: tuple[str, ...]  # IA3's feed-forward subset of ``linear``
    embed: str  # the input embedding
    norms: tuple[str, ...]  # LayerNorm tuning
    save: tuple[str, ...]  # a module for ``modules_to_save``
    conv1d: bool = False  # GPT-2's ``Conv1D`` stores W as (in, out): ``fan_in_fan_out=True``


MODELS: dict[str, ModelSpec] = {
    "gpt2": ModelSpec(
        "gpt2",
        gpt2,
        lambda: causal_batches()[0],
        "CAUSAL_LM",
        linear=("c_attn", "c_fc"),
        ff=("c_fc",),
        embed="wte",
        norms=("ln_1", "ln_2"),
        save=("wpe",),  # position ids built with batch size 1 (DESIGN rule 5)
        conv1d=True,
    ),
    "llama": ModelSpec(
        "llama",
        llama,
        lambda: causal_batches()[0],
        "CAUSAL_LM",
        linear=("q_proj", "v_proj", "down_proj"),
        ff=("down_proj",),
        embed="embed_tokens",
        norms=("input_layernorm", "post_attention_layernorm"),
        save=("lm_head",),
    ),
    "bert": ModelSpec(
        "bert",
        bert_classifier,
        lambda: classification_batches()[0],
        "SEQ_CLS",  # peft adds the classifier to modules_to_save
        linear=("query", "value", "intermediate.dense"),
        ff=("intermediate.dense",),
        embed="word_embeddings",
        norms=("LayerNorm",),
        save=("pooler",),
    ),
    "t5": ModelSpec(
        "t5",
        t5,
        lambda: seq2seq_batches()[0],
        "SEQ_2_SEQ_LM",
        linear=("q", "v", "wi"),
        ff=("wi",),
        embed="shared",
        norms=("layer_norm",),
        save=("lm_head",),  # tied with ``shared``: the copy is trained on its own
    ),
}

Built = tuple[peft.PeftConfig, dict]
Builder = Callable[[ModelSpec, torch.nn.Module, str], Built]


def _t(spec: ModelSpec) -> list[str]:
    return list(spec.linear)


def _fan(spec: ModelSpec) -> dict:
    return {"fan_in_fan_out": True} if spec.conv1d else {}


def _task_ids() -> dict:
    """``task_ids`` per example (a callable of the batch): both tasks occur."""
    return {"task_ids": lambda batch: torch.arange(batch["input_ids"].shape[0]) % 2}


def _multitask_prompt(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    cfg = peft.MultitaskPromptTuningConfig(task_type=spec.task_type, num_virtual_tokens=3, num_tasks=2, num_ranks=1)
    forward = _task_ids()
    if spec.task_type == "SEQ_2_SEQ_LM":  # peft prepends the prompt to the decoder too, from labels it shifts itself
        forward.update(labels=lambda batch: batch["labels"], decoder_input_ids=None)
    return cfg, forward


def _lora(**kw) -> Builder:
    def build(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
        args = {"r": 2, "lora_alpha": 4, "target_modules": _t(spec), "task_type": spec.task_type, **_fan(spec)}
        args.update(kw.get("per_model", lambda s: {})(spec))
        args.update({k: v for k, v in kw.items() if k != "per_model"})
        return peft.LoraConfig(**args), {}

    return build


def _simple(cls_name: str, fan: bool = False, forward: Callable[[], dict] | None = None, **kw) -> Builder:
    """A tuner whose config takes ``target_modules`` (the model's ``linear``) and ``kw``; ``fan``: it takes
    ``fan_in_fan_out`` (set on GPT-2); ``forward``: the extra keyword arguments of the forward."""

    def build(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
        cls = getattr(peft, cls_name)
        args = {"target_modules": _t(spec), "task_type": spec.task_type, **kw}
        if fan:
            args.update(_fan(spec))
        return cls(**args), (forward() if forward else {})

    return build


def _prompt(cls_name: str, **kw) -> Builder:
    def build(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
        cls = getattr(peft, cls_name)
        return cls(task_type=spec.task_type, **kw), {}

    return build


def _adaption_prompt(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    return peft.AdaptionPromptConfig(adapter_len=2, adapter_layers=1, task_type=spec.task_type), {}


def _ia3(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    cfg = peft.IA3Config(
        target_modules=_t(spec), feedforward_modules=list(spec.ff), task_type=spec.task_type, **_fan(spec)
    )
    return cfg, {}


def _ln_tuning(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    return peft.LNTuningConfig(target_modules=list(spec.norms), task_type=spec.task_type), {}


def _trainable_tokens(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    return peft.TrainableTokensConfig(token_indices=[3, 5, 7], target_modules=[spec.embed], init_weights=False), {}


def _xlora(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    """Two LoRA experts saved to ``tmp`` (offline), mixed by X-LoRA's trainable classifier."""
    base.config.use_cache = False  # X-LoRA refuses a model that caches
    adapters = {}
    for k in range(2):
        torch.manual_seed(100 + k)
        expert = peft.get_peft_model(
            spec.build(), peft.LoraConfig(r=2, target_modules=_t(spec), init_lora_weights=False, **_fan(spec))
        )
        path = os.path.join(tmp, f"expert{k}")
        expert.save_pretrained(path)
        adapters[str(k)] = path
    cfg = peft.XLoraConfig(
        task_type=spec.task_type, hidden_size=16, adapters=adapters, xlora_depth=2, xlora_size=8, xlora_dropout_p=0.0
    )
    return cfg, {}


def _cpt(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    """CPT's forward pops ``labels`` (its own loss when given): ``labels=None``, and the sweep's loss."""
    ids, types = [4, 5, 6], [1, 2, 2]
    cfg = peft.CPTConfig(cpt_token_ids=ids, cpt_mask=[1, 1, 1], cpt_tokens_type_mask=types, task_type="CAUSAL_LM")
    return cfg, {"labels": None}


def _shadow(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    """ShaDow wraps whole decoder blocks (``target_modules=None``: every one) with a parallel shadow network."""
    return peft.ShadowConfig(r=2, shadow_dropout=0.0, shadow_num_hidden_layers=1, task_type=spec.task_type), {}


def _psoft(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    """PSOFT's SVD initialisation refuses float64: built in float32, then the model goes to float64."""
    base.float()
    return peft.PsoftConfig(r=2, psoft_alpha=2, target_modules=_t(spec), task_type=spec.task_type, **_fan(spec)), {}


def _road(spec: ModelSpec, base: torch.nn.Module, tmp: str) -> Built:
    return peft.RoadConfig(variant="road_2", group_size=4, target_modules=_t(spec), task_type=spec.task_type), {}


# name -> (peft type, builder). LoRA variants carry the ``lora-`` prefix.
TUNERS: dict[str, tuple[str, Builder]] = {
    "lora": ("LORA", _lora(init_lora_weights=False)),
    "lora-dropout": ("LORA", _lora(lora_dropout=0.3)),
    "lora-rslora": ("LORA", _lora(use_rslora=True)),
    "lora-bias": ("LORA", _lora(lora_bias=True)),
    "lora-modules-to-save": ("LORA", _lora(per_model=lambda s: {"modules_to_save": list(s.save)})),
    "lora-embedding": ("LORA", _lora(per_model=lambda s: {"target_modules": [s.embed, s.linear[0]]})),
    "lora-trainable-tokens": ("LORA", _lora(trainable_token_indices=[3, 5, 7])),
    "lora-dora": ("LORA", _lora(use_dora=True)),
    "lora-dora-dropout": ("LORA", _lora(use_dora=True, lora_dropout=0.3)),
    "adalora": ("ADALORA", _simple("AdaLoraConfig", fan=True, init_r=4, target_r=2, total_step=10)),
    "adamss": ("ADAMSS", _simple("AdamssConfig", r=8, num_subspaces=2, subspace_rank=1)),
    "adaption_prompt": ("ADAPTION_PROMPT", _adaption_prompt),
    "beft": ("BEFT", _simple("BeftConfig")),
    "boft": ("BOFT", _simple("BOFTConfig", fan=True, boft_block_size=4, boft_n_butterfly_factor=1)),
    "c3a": ("C3A", _simple("C3AConfig", block_size=8)),
    "cartridge": ("CARTRIDGE", _prompt("CartridgeConfig", num_virtual_tokens=3, num_frozen_tokens=1)),
    "cpt": ("CPT", _cpt),
    "deft": ("DEFT", _simple("DeftConfig", fan=True, r=2)),
    "delora": ("DELORA", _simple("DeloraConfig", r=2)),
    "fourierft": ("FOURIERFT", _simple("FourierFTConfig", fan=True, n_frequency=20, init_weights=False)),
    "frod": ("FROD", _simple("FrodConfig", fan=True, sparse_rate=0.2, progressbar=False)),
    "glora": ("GLORA", _simple("GloraConfig", r=2)),
    "gralora": ("GRALORA", _simple("GraloraConfig", fan=True, r=4, alpha=8, gralora_k=2)),
    "hira": ("HIRA", _simple("HiraConfig", fan=True, r=2)),
    "hra": ("HRA", _simple("HRAConfig", r=2)),
    "ia3": ("IA3", _ia3),
    "lily": ("LILY", _simple("LilyConfig", r=2, num_B=2, stride_A=1)),
    "ln_tuning": ("LN_TUNING", _ln_tuning),
    "loha": ("LOHA", _simple("LoHaConfig", r=2, alpha=4)),
    "lokr": ("LOKR", _simple("LoKrConfig", r=2, alpha=4)),
    "miss": ("MISS", _simple("MissConfig", r=4)),
    "multitask_prompt_tuning": ("MULTITASK_PROMPT_TUNING", _multitask_prompt),
    "oft": ("OFT", _simple("OFTConfig", fan=True, r=0, oft_block_size=4)),
    "osf": ("OSF", _simple("OSFConfig", effective_rank=4)),
    "p_tuning": ("P_TUNING", _prompt("PromptEncoderConfig", num_virtual_tokens=3, encoder_hidden_size=8)),
    "peanut": ("PEANUT", _simple("PeanutConfig", r=2)),
    "poly": ("POLY", _simple("PolyConfig", forward=_task_ids, r=2, n_tasks=2, n_skills=2, n_splits=1)),
    "prefix_tuning": ("PREFIX_TUNING", _prompt("PrefixTuningConfig", num_virtual_tokens=3)),
    "prefix_tuning-projection": (
        "PREFIX_TUNING",
        _prompt("PrefixTuningConfig", num_virtual_tokens=3, prefix_projection=True, encoder_hidden_size=8),
    ),
    "prompt_tuning": ("PROMPT_TUNING", _prompt("PromptTuningConfig", num_virtual_tokens=3)),
    "psoft": ("PSOFT", _psoft),
    "pvera": ("PVERA", _simple("PveraConfig", fan=True, r=4)),
    "randlora": ("RANDLORA", _simple("RandLoraConfig", fan=True, r=2, randlora_alpha=4)),
    "road": ("ROAD", _road),
    "shadow": ("SHADOW", _shadow),
    "shira": ("SHIRA", _simple("ShiraConfig", fan=True, r=2, random_seed=0)),
    "supertuning": ("SUPERTUNING", _simple("SupertuningConfig", sparsity=0.8)),
    "tinylora": ("TINYLORA", _simple("TinyLoraConfig", fan=True, r=2, u=4)),
    "trainable_tokens": ("TRAINABLE_TOKENS", _trainable_tokens),
    "unilora": ("UNILORA", _simple("UniLoraConfig", fan=True, r=2, theta_d_length=32)),
    "vblora": ("VBLORA", _simple("VBLoRAConfig", fan=True, r=2, num_vectors=8, vector_length=8, topk=2)),
    "vera": ("VERA", _simple("VeraConfig", fan=True, r=4)),
    "waveft": ("WAVEFT", _simple("WaveFTConfig", fan=True, n_frequency=16)),
    "xlora": ("XLORA", _xlora),
}

#: The default dtype a tuner's runs use (float64 parameters either way): FourierFT builds its dense spectrum in the
#: default dtype and fills it with ``spectrum.float()``, so it runs only where the default is float32 (its delta weight
#: is then computed in float32 inside the float64 model, and the sweep's one-backward oracle applies).
DEFAULT_DTYPE: dict[str, torch.dtype] = {"fourierft": torch.float32}
