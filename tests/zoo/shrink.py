"""Tiny configs for every model type of transformers' auto mappings, from each type's default config.

``tiny_config(model_type)`` starts from ``AutoConfig.for_model(model_type)`` (no download) and shrinks it by attribute
*name*: widths to 32, heads to 4 (kv heads 2), head dims to 8, feed-forward sizes to 64 (32 for experts), layers to 2
(or the number of distinct per-layer types, at most 4), experts to 4 with top-2, vocabularies to 99, positions to 64,
images to 32x32 with patches of 8, dropouts to 0; sub-configs (``text_config``, ``vision_config``, ``encoder``, ...)
are shrunk the same way. Special token ids are moved into the small vocabulary (90..98). ``OVERRIDES`` holds the few
per-type settings that the generic rules cannot get right.

``TASKS`` names the five auto mappings of the sweep and ``task_types(task)`` their model types.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

VOCAB = 99
SPECIAL_IDS = range(90, 99)  # special token ids live here; inputs are drawn from [3, 90)
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 64
EXPERT_FFN = 32
EXPERTS = 4
TOP_K = 2
LAYERS = 2
POSITIONS = 64
IMAGE = 32
PATCH = 8
RANK = 8
MAX_PARAMS = 6_000_000  # larger after shrinking: a generic rule missed a width (recorded as skipped)

TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "token-cls": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}

#: per-type settings the generic rules cannot infer (applied last, to the top-level config).
OVERRIDES: dict[str, dict[str, Any]] = {
    # attention every 2nd layer from layer 0, experts on layer 1: both kinds in 2 layers
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 0, "expert_layer_period": 2, "expert_layer_offset": 1},
    "deepseek_v2": {"first_k_dense_replace": 1},
    # experts in layer 1 of 2 (from the default sparse steps, 2 layers get none)
    "nllb-moe": {"encoder_sparse_step": 2, "decoder_sparse_step": 2},
    "switch_transformers": {"encoder_sparse_step": 2, "decoder_sparse_step": 2},
    "deepseek_v3": {"first_k_dense_replace": 1},
    "mamba2": {"num_heads": 8},  # num_heads * head_dim == expand * hidden_size
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    "reformer": {"is_decoder": True},
    "layoutlmv3": {"coordinate_size": 4, "shape_size": 8},  # 4 * coordinate_size + 2 * shape_size == hidden_size
    "cvt": {"depth": [1, 2, 3]},  # stage i reads drop_path_rates[i] from a list of depth[i] rates
    # windows of 2 patches on a 16x16 patch grid: every stage's resolution stays a multiple of the window
    "swin": {"window_size": 2, "image_size": 64},
    "donut-swin": {"window_size": 2, "image_size": 64},
    "levit": {"patch_size": 16},  # its attention biases assume image_size / 16 patches
    "efficientnet": {"width_coefficient": 0.25, "hidden_dim": 320},  # hidden_dim = round_filters(1280)
    "mobilevitv2": {"width_multiplier": 0.25},
}

_HIDDEN_NAMES = {
    "hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "hidden_dim", "emb_dim", "embedding_dim",
    "word_embed_proj_dim", "model_dim", "d_embed", "embedding_size", "projection_dim", "true_hidden_size",
    "intra_bottleneck_size", "attention_hidden_size", "lru_width", "hidden_size_global", "encoder_hidden_size",
    "decoder_hidden_size", "cross_attention_hidden_size", "pooler_hidden_size", "d_latents", "input_embedding_size",
    "output_embedding_size", "hidden_size_per_layer_input", "out_hidden_size", "projection_size", "vision_output_dim",
    "text_hidden_size", "vision_hidden_size",
}  # fmt: skip
_HEAD_DIM_NAMES = {
    "head_dim", "d_kv", "d_head", "dim_head", "attention_head_dim", "kv_channels", "v_head_dim", "qk_head_dim",
    "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim",
    "index_head_dim", "swa_head_dim", "linear_head_dim", "attention_head_size", "d_rel",
}  # fmt: skip
_ROPE_DIM_NAMES = {"qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "rotary_emb_dim"}
_KV_HEAD_NAMES = {
    "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "num_query_groups",
    "linear_num_key_heads", "swa_num_key_value_heads", "n_kv_heads", "index_n_heads",
}  # fmt: skip
_MAMBA_HEAD_NAMES = {"mamba_n_heads", "n_mamba_heads", "mamba_num_heads"}
_STATE_NAMES = {"mamba_d_state", "ssm_state_size", "state_size", "time_step_rank", "mamba_dt_rank", "d_state"}
_LAYER_NAME = re.compile(
    r"^(num_|n_)?(hidden_|encoder_|decoder_|speech_encoder_|conf_num_hidden_|t2u_\w+_)?layers$|^depth$"
)
_NOT_LAYER_COUNT = {"max_window_layers", "num_kv_shared_layers", "num_nextn_predict_layers", "first_k_dense_replace"}
_FFN_NAME = re.compile(r"intermediate|ffn|^d_ff$|^n_inner$|^dim_ff$|^dff$|^d_inner$|^mlp_dim$|^feed_forward_size$")
_EXPERT_COUNT = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_total"}
_TOP_K = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k", "num_selected_experts"}
_POSITION_NAME = re.compile(
    r"^(max_|n_)?(\w+_)?(position_embeddings|positions)$|^n_ctx$|^max_seq_len$|^max_sequence_length$|^context_length$"
)
_TOKEN_ID = re.compile(r"_token_(id|index)$|^(pad|bos|eos|sep|cls|mask|unk|decoder_start)_token_id$|_token_ids$")
_LIST_WIDTHS = {"hidden_sizes", "embed_dims", "neck_hidden_sizes", "embed_dim", "stage_out_channels",
                "stage_mid_channels", "stage_in_channels", "stem_channels", "hidden_dims"}  # fmt: skip
_LIST_DEPTHS = {"depths", "depth", "stage_num_blocks", "num_block_repeats", "block_repeats", "stage_numb_of_layers",
                "num_hidden_layers", "num_layers"}  # fmt: skip
_LIST_HEADS = {"num_heads", "num_attention_heads", "attention_heads", "num_attention_heads_per_layer"}
_SKIP_KEYS = {"id2label", "label2id", "architectures", "transformers_version", "dtype", "torch_dtype", "stage_names"}


def task_types(task: str) -> dict[str, str]:
    """``model_type -> class name`` of one task's auto mapping (a tuple of classes: the first)."""
    from transformers.models.auto import modeling_auto

    mapping = getattr(modeling_auto, TASKS[task])
    return {t: (c[0] if isinstance(c, (tuple, list)) else c) for t, c in mapping.items()}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_count(cfg) -> int | None:
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers"):
        v = getattr(cfg, name, None)
        if _is_int(v) and v > 0:
            return v
    return None


def _per_layer_lists(cfg, n_orig: int | None) -> dict[str, list]:
    if not n_orig or n_orig <= 4 or hasattr(cfg, "depths"):  # stage lists of hierarchical models are not layers
        return {}
    out = {}
    for k, v in vars(cfg).items():
        if k in _SKIP_KEYS or k.startswith("_") and k != "_sliding_window_pattern":
            continue
        if k in _LIST_DEPTHS or k in _LIST_WIDTHS or k in _LIST_HEADS or "size" in k or "stride" in k:
            continue
        if isinstance(v, (list, tuple)) and len(v) == n_orig:
            out[k] = list(v)
    return out


def _distinct(values: list) -> list:
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def shrink_overrides(cfg, *, top: bool) -> dict[str, Any]:
    """Name-based overrides for one config object (sub-configs recursively, as dicts)."""
    from transformers import PretrainedConfig

    over: dict[str, Any] = {}
    n_orig = _layer_count(cfg)
    per_layer = _per_layer_lists(cfg, n_orig)
    kinds = [len(_distinct(v)) for k, v in per_layer.items() if not all(_is_int(x) for x in v)]
    n_layers = min(4, max([LAYERS, *kinds])) if n_orig else LAYERS
    heads_orig = None
    for name in ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads"):
        if _is_int(getattr(cfg, name, None)):
            heads_orig = getattr(cfg, name)
            break
    for k, v in list(vars(cfg).items()):
        if k in _SKIP_KEYS or (k.startswith("_") and k not in ("_sliding_window_pattern",)):
            continue
        if isinstance(v, PretrainedConfig):
            sub = v.to_dict()
            for drop in _SKIP_KEYS:
                sub.pop(drop, None)
            sub.update(shrink_overrides(v, top=False))
            over[k] = sub
            continue
        if isinstance(v, float) and ("drop" in k or "jitter" in k) and v > 0:
            over[k] = 0.0
            continue
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, float) for x in v) and "drop" in k:
            over[k] = type(v)(0.0 for _ in v)
            continue
        if isinstance(v, dict) and v and n_orig and all(str(x).isdigit() for x in v):  # {layer index: ...}
            over[k] = {x: y for x, y in v.items() if int(x) < n_layers}
            continue
        if k in _TOP_K and v is None and is_moe(cfg):
            over[k] = TOP_K
            continue
        if k == "vocab_size" and v is None:
            over[k] = VOCAB
            continue
        if k in per_layer:
            vals = per_layer[k]
            if all(_is_int(x) for x in vals):
                shrunk = [_shrink_int(k.replace("_per_layer", ""), x, n_layers, heads_orig) for x in vals[:n_layers]]
                over[k] = [x if s is None else s for x, s in zip(vals[:n_layers], shrunk, strict=True)]
            else:
                d = _distinct(vals)
                over[k] = [d[i % len(d)] for i in range(n_layers)] if len(d) > 1 else vals[:n_layers]
            continue
        if isinstance(v, (list, tuple)) and v and all(_is_int(x) for x in v):
            new = _shrink_int_list(k, list(v), n_orig, n_layers)
            if new is not None:
                over[k] = type(v)(new) if isinstance(v, tuple) else new
            continue
        if isinstance(v, (list, tuple)) and _TOKEN_ID.search(k) and all(_is_int(x) for x in v):
            continue
        if not _is_int(v):
            continue
        new = _shrink_int(k, v, n_layers, heads_orig, getattr(cfg, "model_type", "") or "")
        if new is not None and new != v:
            over[k] = new
    rope = getattr(cfg, "qk_rope_head_dim", None)
    if _is_int(rope) and getattr(cfg, "head_dim", None) == rope and "qk_rope_head_dim" in over:
        over["head_dim"] = over["qk_rope_head_dim"]  # MLA: the rotary embedding's head_dim is the rope part
    _move_token_ids(cfg, over)
    if top:
        over.update(OVERRIDES.get(getattr(cfg, "model_type", ""), {}))
    return over


def _shrink_int_list(k: str, v: list[int], n_orig: int | None, n_layers: int) -> list[int] | None:
    if k in _LIST_WIDTHS and v[0] > 16:
        return [max(8, round(x * 16 / v[0] / 8) * 8) for x in v]  # multiples of 8: divisible by the heads
    if k in _LIST_DEPTHS:
        return [1] * len(v)
    if k in _LIST_HEADS and v[0] >= 1:
        return [max(1, x // v[0]) for x in v]
    if k in ("image_size", "input_size", "crop_size") and len(v) == 2:
        return [IMAGE, IMAGE]
    if k == "patch_size" and len(v) == 2:
        return [min(v[0], PATCH), min(v[1], PATCH)]
    if n_orig and ("layer" in k or "idx" in k or "index" in k) and all(0 <= x < n_orig for x in v):
        return sorted({x for x in v if x < n_layers})  # layer indices
    return None


def _shrink_int(k: str, v: int, n_layers: int, heads_orig: int | None, model_type: str = "") -> int | None:
    if k in _HIDDEN_NAMES:
        return HIDDEN if v > HIDDEN else v
    if k in _HEAD_DIM_NAMES:
        return HEAD_DIM if v > HEAD_DIM else v
    if k in _ROPE_DIM_NAMES:
        return 4 if v > 4 else v
    if k in _KV_HEAD_NAMES:
        if v <= 1:
            return v
        return KV_HEADS if heads_orig is None or v < heads_orig else HEADS
    if k == "linear_num_value_heads":
        return HEADS
    if k in _MAMBA_HEAD_NAMES:
        return 8 if v > 8 else v
    if k in _STATE_NAMES:
        return 8 if v > 8 else v
    if (k.endswith("heads") or k in ("n_head", "num_head")) and "kv" not in k and "key_value" not in k:
        return HEADS if v > HEADS else v
    if k in _NOT_LAYER_COUNT:
        if k == "max_window_layers":
            return min(v, n_layers)
        return 0 if k == "num_kv_shared_layers" else min(v, 1)
    if _LAYER_NAME.search(k) or k in ("num_self_attends_per_block", "n_input_layers", "n_recurrent_layers"):
        return n_layers if v > n_layers else v
    if k in _EXPERT_COUNT or (k.startswith("num_") and k.endswith("_experts") and "shared" not in k):
        return EXPERTS if v > EXPERTS or (v == 1 and "moe" in model_type) else v
    if k in _TOP_K:
        return TOP_K if v > TOP_K else v
    if k in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        return min(v, 1)
    if k in ("n_group", "num_expert_group", "topk_group"):
        return 1
    if k == "num_groups":  # GroupNorm groups
        return 2 if v > 2 else v
    if "lora_rank" in k or k.endswith("_rank") or k == "hc_lowrank":
        return RANK if v > RANK else v
    if _FFN_NAME.search(k) and "round" not in k and "ratio" not in k:
        small = EXPERT_FFN if ("moe" in k or "expert" in k or "shared" in k) else FFN
        return small if v > small else v
    if ("vocab_size" in k and k not in ("type_vocab_size",)) or ("vocab" in k and v >= 1000):
        return VOCAB if v > VOCAB else v
    if _POSITION_NAME.search(k) or k == "original_max_position_embeddings":
        return POSITIONS if v > POSITIONS else v
    if k in ("image_size", "crop_size"):
        return IMAGE if v > IMAGE else v
    if k == "patch_size":
        return PATCH if v > PATCH else v
    if k in ("sliding_window", "window_size", "sliding_window_size", "attention_window", "local_attention"):
        return 4 if v > 4 else v
    if k in ("num_labels",):
        return None
    if re.search(r"(size|_dim|channels|width)$", k) and v >= 128:
        return HIDDEN
    return None


def _move_token_ids(cfg, over: dict[str, Any]) -> None:
    slots = iter(SPECIAL_IDS)
    mapping: dict[int, int] = {}
    for k, v in vars(cfg).items():
        if not _TOKEN_ID.search(k):
            continue
        vals = v if isinstance(v, (list, tuple)) else [v]
        if not all(_is_int(x) for x in vals) or not vals:
            continue
        new = []
        for x in vals:
            if x < 3 or x in SPECIAL_IDS:
                new.append(x)
                continue
            if x not in mapping:
                mapping[x] = next(slots, SPECIAL_IDS[-1])
            new.append(mapping[x])
        if new != list(vals):
            over[k] = type(v)(new) if isinstance(v, (list, tuple)) else new[0]


class TooLarge(Exception):
    pass


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


def _fill_none(cfg) -> None:
    """Derived fields some configs leave ``None`` (their models then divide by them)."""
    from transformers import PretrainedConfig

    heads = getattr(cfg, "num_attention_heads", None)
    if _is_int(heads):
        if "num_key_value_heads" in vars(cfg) and cfg.num_key_value_heads is None:
            cfg.num_key_value_heads = heads
        hidden = getattr(cfg, "hidden_size", None)
        if "head_dim" in vars(cfg) and cfg.head_dim is None and _is_int(hidden):
            cfg.head_dim = hidden // heads
    for v in vars(cfg).values():
        if isinstance(v, PretrainedConfig):
            _fill_none(v)


def _fill_task_ids(cfg) -> None:
    """A pad token (sequence classification of a padded batch needs one) and a decoder start token."""
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False  # training: no cache (hybrid models' caches need an attention layer)
    if getattr(cfg, "pad_token_id", None) is None:
        cfg.pad_token_id = 0
    if getattr(cfg, "is_encoder_decoder", False) and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = cfg.pad_token_id
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if text is not cfg:
        _fill_task_ids(text)


def _set_in_place(cfg, over: dict[str, Any]) -> None:
    from transformers import PretrainedConfig

    for k, v in over.items():
        cur = getattr(cfg, k, None)
        if isinstance(cur, PretrainedConfig) and isinstance(v, dict):
            _set_in_place(cur, shrink_overrides(cur, top=False))
        else:
            try:
                setattr(cfg, k, v)
            except Exception:  # noqa: BLE001  (a read-only or validated attribute: keep the default)
                pass


def tiny_configs(model_type: str, **extra):
    """Candidate shrunk configs of ``model_type``, best first (``extra`` on top, e.g. ``num_labels``):
    sub-configs rebuilt from their dict; the same without per-layer lists; sub-configs shrunk in place."""
    from transformers import AutoConfig, PretrainedConfig

    ctx = _quiet()
    try:
        base = AutoConfig.for_model(model_type)
        over = shrink_overrides(base, top=True)
        over.update(extra)
        n_orig = _layer_count(base)
        no_lists = {k: v for k, v in over.items() if k not in _per_layer_lists(base, n_orig)}
        top_only = {k: v for k, v in over.items() if not isinstance(getattr(base, k, None), PretrainedConfig)}
        attempts = [("dict", over), ("no-per-layer-lists", no_lists), ("in-place", top_only)]
        for how, kwargs in attempts:
            try:
                cfg = AutoConfig.for_model(model_type, **kwargs)
                if how == "in-place":
                    _set_in_place(cfg, over)
                _fill_none(cfg)
            except Exception as err:  # noqa: BLE001  (the next candidate)
                yield how, err
                continue
            yield how, cfg
    finally:
        ctx.__exit__(None, None, None)


def tiny_config(model_type: str, **extra):
    """The first shrunk config that validates (raises the last error when none does)."""
    err = None
    for _, cfg in tiny_configs(model_type, **extra):
        if not isinstance(cfg, Exception):
            return cfg
        err = cfg
    raise err


def _for_class(cfg, cls):
    """A composite config (``llama4``, ``qwen3_5``) for a class that takes one of its sub-configs."""
    from transformers import PretrainedConfig

    want = getattr(cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for v in vars(cfg).values():
        if isinstance(v, want):
            return v
    if isinstance(cfg, PretrainedConfig) and hasattr(cfg, "get_text_config"):
        text = cfg.get_text_config()
        if isinstance(text, want):
            return text
    return cfg


def build_tiny(
    model_type: str,
    cls,
    dtype=None,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    seed: int = 0,
    **extra,
):
    """``(model, how)``: the first candidate config that builds ``cls``; raises the last error when none does."""
    import torch

    last = None
    for how, cfg in tiny_configs(model_type, **extra):
        if isinstance(cfg, Exception):
            last = cfg
            continue
        cfg = _for_class(cfg, cls)
        kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        if experts_implementation is not None:
            kwargs["experts_implementation"] = experts_implementation
        _fill_task_ids(cfg)
        previous = torch.get_default_dtype()
        if dtype is not None:
            torch.set_default_dtype(dtype)
        ctx = _quiet()
        try:
            try:  # count on the meta device first: a shrink that missed a width must not cost minutes to build
                with torch.device("meta"):
                    n_params = count_params(cls._from_config(copy.deepcopy(cfg), **kwargs))
            except Exception:  # noqa: BLE001  (some models cannot be built on meta: build them for real)
                n_params = 0
            if n_params > MAX_PARAMS:
                raise TooLarge(f"{n_params / 1e6:.1f}M parameters after shrinking (a width the shrinker misses)")
            torch.manual_seed(seed)
            model = cls._from_config(cfg, **kwargs)
            if dtype is not None:
                model = model.to(dtype)
            return model, how
        except TooLarge:
            raise
        except Exception as err:  # noqa: BLE001  (the next candidate)
            last = err
        finally:
            ctx.__exit__(None, None, None)
            torch.set_default_dtype(previous)
    raise last


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def is_moe(config) -> bool:
    """Whether the config (or a sub-config) has more than one expert."""
    from transformers import PretrainedConfig

    for k, v in vars(config).items():
        if isinstance(v, PretrainedConfig) and is_moe(v):
            return True
        if _is_int(v) and v > 1 and (k in _EXPERT_COUNT or (k.startswith("num_") and k.endswith("experts"))):
            if "shared" not in k and "per_tok" not in k:
                return True
    return False
