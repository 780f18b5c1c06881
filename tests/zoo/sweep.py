"""The zoo sweep: every model type of five auto mappings, tiny and random, against the float64 per-example oracle.

One *pair* is ``(task, model_type)``; one *run* is a pair in one clipping ``mode`` and one *variant*:

* ``default``: float64, the model's default attention;
* ``eager``: float64, ``attn_implementation="eager"`` (only where the default is not already eager);
* ``fp32``: float32 (MoE types only; transformers' default grouped_mm experts), the oracle still in float64;
* ``experts-eager``: float64, ``experts_implementation="eager"`` (MoE only: the per-expert loop);

In float64 the MoE types run with ``experts_implementation="batched_mm"`` (grouped_mm has no float64 kernel).
* ``lora``: float64, PEFT LoRA ``r=2`` on ``target_modules="all-linear"`` (causal LM only).

Each run is classified as

* ``exact``: every per-example total norm and every parameter's clipped sum (relative to that parameter's own norm)
  within 1e-6 (float64) or 1e-3 (float32) of the oracle;
* ``refused``: hf_dp raised ``UnsupportedModuleError`` / ``ValueError`` / ``NotImplementedError`` itself (the
  traceback's last frame is inside the installed ``hf_dp`` package), leaving every ``p.grad`` as it was;
* ``wrong``: no error, but numbers that differ (the worst parameters and their engine/oracle norm ratio), or a refusal
  that left something in ``p.grad``;
* ``unclear``: any other exception while the engine ran;
* ``skipped``: the model could not be built or run without the engine (missing package, config, forward error).

The batch: 3 examples of 8 tokens, the second one padded over its last 3 positions (``attention_mask`` 0, labels
-100); seq2seq: 5 decoder tokens, the second example's last 2 labels -100; images: 3 random 32x32 images.
The loss is hf_dp's ``per_example_loss`` for the task (the harness's random projection of the logits where it does not
apply); ``C`` is the median per-example norm, so one example is clipped and one is not.
"""

from __future__ import annotations

import copy
import gc
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), os.path.join(os.path.dirname(_HERE), "peers"), _HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
from harness import _raised_by_hf_dp, project  # noqa: E402
from helpers.oracle import clip_factors, oracle_clipped  # noqa: E402
from shrink import MAX_PARAMS, TASKS, TooLarge, build_tiny, count_params, is_moe, task_types, tiny_config  # noqa: E402

import hf_dp  # noqa: E402
from hf_dp import BookKeepingClipper  # noqa: E402
from hf_dp.losses import per_example_loss  # noqa: E402

MODES = ("bk-mixopt", "bk", "ghost", "per-sample")
VARIANTS = ("default", "eager", "fp32", "experts-eager", "lora")
OUTCOMES = ("exact", "refused", "wrong", "unclear", "skipped")
B, T, T_DEC, PAD = 3, 8, 5, 3
NUM_LABELS = 3
LOSS_TYPES = {
    "causal-lm": "causal_lm",
    "seq-cls": "sequence_classification",
    "seq2seq": "seq2seq_lm",
    "token-cls": "token_classification",
    "image-cls": "sequence_classification",
}
REFUSAL_TYPES = (ValueError, NotImplementedError)  # UnsupportedModuleError is a ValueError
HF_DP_DIR = os.path.dirname(os.path.abspath(hf_dp.__file__))


@dataclass
class Run:
    """The outcome of one (task, model_type, mode, variant)."""

    task: str
    model_type: str
    mode: str
    variant: str
    outcome: str
    detail: str = ""
    worst: str = ""  # the worst parameter (wrong) or the module the refusal names
    ratio: float | None = None  # ||engine|| / ||oracle|| of the worst parameter
    rel_err: float | None = None
    plain_s: float | None = None  # steady-state plain forward+backward
    steady_s: float | None = None  # steady-state engine step (forward + clipper.backward)
    first_s: float | None = None  # the engine's first step (construction + forward + clipper.backward)
    family: str = ""

    def line(self) -> str:
        text = f"{self.outcome:8s} {self.task:9s} {self.model_type:28s} {self.mode:10s} {self.variant:7s}"
        if self.worst:
            ratio = f" {self.ratio:.3g}x" if self.ratio is not None else ""
            err = f" (rel err {self.rel_err:.1e})" if self.rel_err is not None else ""
            text += f" worst={self.worst}{ratio}{err}"
        if self.steady_s is not None and self.plain_s:
            text += f" steady={self.steady_s / self.plain_s:.2f}x first={self.first_s / self.plain_s:.2f}x"
            text += f" plain={self.plain_s * 1e3:.1f}ms"
        if self.detail:
            text += f" | {self.detail}"
        return text


class PairTimeout(Exception):
    pass


def _alarm(seconds: int):
    def handler(signum, frame):
        raise PairTimeout(f"took more than {seconds} s")

    if seconds and hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, handler)
        signal.alarm(seconds)


def _short(err: BaseException, n: int = 300) -> str:
    return f"{type(err).__name__}: " + " ".join(str(err).split())[:n]


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)[-2:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


def family(config, task: str, model=None) -> str:
    """A coarse architecture family for the summary."""
    names = " ".join(k for k in _all_keys(config))
    if task == "image-cls":
        return "vision"
    if is_moe(config) or (model is not None and any(n.endswith(".experts") for n, _ in model.named_modules())):
        return "MoE"
    if "mamba" in names or "ssm" in names or "linear_num" in names or "state_size" in names:
        return "hybrid/SSM"
    if getattr(config, "is_encoder_decoder", False) or task == "seq2seq":
        return "encoder-decoder"
    if task == "causal-lm":
        return "decoder"
    return "encoder"


def _all_keys(config) -> Iterator[str]:
    from transformers import PretrainedConfig

    for k, v in vars(config).items():
        yield k
        if isinstance(v, PretrainedConfig):
            yield from _all_keys(v)


# ----------------------------------------------------------------------------------------------------- the batch
def make_batch(task: str, config) -> dict:
    """Inputs and labels for one task (``labels_*`` keys are labels, not model inputs)."""
    g = torch.Generator().manual_seed(1234)
    if task == "image-cls":
        size = getattr(config, "image_size", 32)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(config, "num_channels", 3) or 3
        return {
            "pixel_values": torch.randn((B, channels, *size), generator=g, dtype=torch.float64),
            "labels_labels": torch.arange(B) % NUM_LABELS,
        }
    pad = getattr(config, "pad_token_id", None)
    pad = 0 if not isinstance(pad, int) else pad
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 99
    ids = torch.randint(3, max(4, min(90, vocab)), (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - PAD :] = 0
    ids[1, T - PAD :] = pad
    batch = {"input_ids": ids, "attention_mask": mask}
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if task == "seq-cls" and isinstance(eos, int):  # encoder-decoder classifiers pool the last <eos>
        lengths = mask.sum(1)
        ids[torch.arange(B), lengths - 1] = eos
    if task == "causal-lm":
        batch["labels_labels"] = ids.masked_fill(mask == 0, -100)
    elif task in ("seq-cls",):
        batch["labels_labels"] = torch.arange(B) % NUM_LABELS
    elif task == "token-cls":
        batch["labels_labels"] = torch.randint(0, NUM_LABELS, (B, T), generator=g).masked_fill(mask == 0, -100)
    elif task == "seq2seq":
        dec = torch.randint(3, 90, (B, T_DEC), generator=g)
        labels = torch.randint(3, 90, (B, T_DEC), generator=g)
        labels[1, T_DEC - 2 :] = -100
        batch["decoder_input_ids"] = dec
        batch["labels_labels"] = labels
    return batch


def _inputs(model, batch: dict) -> dict:
    dtype = next(model.parameters()).dtype
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items() if not k.startswith("labels_")}


def make_loss(task: str, batch: dict, probe_model) -> tuple[Callable, str]:
    """``(loss_fn(model, batch) -> [B], how)``: hf_dp's per-example loss for the task where its output fits,
    else the harness's random projection of the logits."""
    loss_type = LOSS_TYPES[task]
    labels = {k[len("labels_") :]: v for k, v in batch.items() if k.startswith("labels_")}

    def forward(model, batch):
        torch.manual_seed(7)  # models that draw at train time draw the same in the oracle and the engine
        return model(**_inputs(model, batch))

    def hf_loss(model, batch):
        return per_example_loss(loss_type, forward(model, batch), labels)

    def projected(model, batch):
        out = forward(model, batch)
        logits = out["logits"] if "logits" in out else out[0]
        return project(logits)

    with torch.no_grad():
        try:
            if hf_loss(probe_model, batch).shape == (B,):
                return hf_loss, loss_type
        except Exception:  # noqa: BLE001  (the output does not fit the task's loss: project the logits)
            pass
        out = projected(probe_model, batch)
        if out.shape != (B,):
            raise ValueError(f"projected loss has shape {tuple(out.shape)}")
    return projected, "projection"


# --------------------------------------------------------------------------------------------------- one pair
@dataclass
class Prepared:
    """One (task, type, variant): the model, the batch, the loss and the oracle's answer."""

    model: torch.nn.Module
    batch: dict
    loss_fn: Callable
    names: list[str]
    norms: torch.Tensor
    clipped_sum: dict[str, torch.Tensor]
    max_grad_norm: float
    dtype: torch.dtype
    loss_how: str
    n_params: int
    family: str = ""
    extras: dict = field(default_factory=dict)


def _class_for(task: str, model_type: str):
    import transformers

    name = task_types(task)[model_type]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(f"transformers has no class {name}")
    return cls


def _with_dtype(dtype):
    class _Ctx:
        def __enter__(self):
            self.previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)

        def __exit__(self, *exc):
            torch.set_default_dtype(self.previous)

    return _Ctx()


def prepare(task: str, model_type: str, variant: str) -> Prepared:
    """Build the model of one variant and the oracle's answer; raises ``Skip`` when it cannot be built or run."""
    cls = _class_for(task, model_type)
    dtype = torch.float32 if variant == "fp32" else torch.float64
    extra = {"num_labels": NUM_LABELS} if task in ("seq-cls", "token-cls", "image-cls") else {}
    attn = "eager" if variant == "eager" else None
    experts = None
    if is_moe(tiny_config(model_type)):
        experts = {"fp32": None, "experts-eager": "eager"}.get(variant, "batched_mm")
    elif variant in ("fp32", "experts-eager"):
        raise NotMoE
    model, _ = build_tiny(
        model_type, cls, dtype=dtype, attn_implementation=attn, experts_implementation=experts, **extra
    )
    if experts is None and variant != "fp32" and any("experts" in n for n, _ in model.named_modules()):
        try:  # an MoE the config does not show (grouped_mm has no float64 kernel)
            model.set_experts_implementation("eager" if variant == "experts-eager" else "batched_mm")
            experts = model.config._experts_implementation
        except Exception:  # noqa: BLE001  (no settable experts: run as built)
            pass
    if hasattr(model, "set_default_language") and getattr(config_of(model), "languages", None):
        model.set_default_language(config_of(model).languages[0])  # X-MOD: adapters per language
    n_params = count_params(model)
    if n_params > MAX_PARAMS:
        raise Skip(f"{n_params / 1e6:.1f}M parameters after shrinking (a width the shrinker misses)")
    config = model.config
    fam = family(config, task, model)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        with _with_dtype(dtype):
            torch.manual_seed(1)
            lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
            model = get_peft_model(model, lora)
        model = model.to(dtype)
    model.train()
    batch = make_batch(task, config)
    with _with_dtype(dtype):
        loss_fn, how = make_loss(task, batch, model)
    ref = copy.deepcopy(model).double()
    if variant == "fp32" and experts is None:  # grouped_mm has no float64 kernel: the oracle uses batched_mm
        base = ref.get_base_model() if hasattr(ref, "get_base_model") else ref
        base.set_experts_implementation("batched_mm")
    with _with_dtype(torch.float64):
        names, norms, clipped_sum, c = oracle_clipped(ref, [batch], loss_fn, None)
    del ref
    norms = norms[0]
    if not bool((norms > c).any()) or not bool(torch.isfinite(norms).all()) or float(norms.max()) == 0:
        raise Skip(f"degenerate per-example norms {norms.tolist()}")
    return Prepared(model, batch, loss_fn, names, norms, clipped_sum, c, dtype, how, n_params, fam)


def config_of(model):
    return model.config


class Skip(Exception):
    pass


class NotMoE(Exception):
    pass


def _named_grads(model) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def _time_plain(prep: Prepared, repeats: int = 2) -> float:
    model = copy.deepcopy(prep.model)
    with _with_dtype(prep.dtype):
        times = []
        for k in range(repeats + 1):
            t0 = time.perf_counter()
            prep.loss_fn(model, prep.batch).sum().backward()
            if k:
                times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_mode(prep: Prepared, task: str, model_type: str, mode: str, variant: str, *, timing: bool = False) -> Run:
    """One engine run against the prepared oracle."""
    run = Run(task, model_type, mode, variant, "exact", family=prep.family)
    model = copy.deepcopy(prep.model)
    rel = 1e-6 if prep.dtype == torch.float64 else 1e-3
    clipper = None
    steps = []
    with _with_dtype(prep.dtype):
        try:
            t0 = time.perf_counter()
            clipper = BookKeepingClipper(model, max_grad_norm=prep.max_grad_norm, mode=mode)
            clipper.backward(prep.loss_fn(model, prep.batch))
            steps.append(time.perf_counter() - t0)
            got_norms = clipper.per_example_norms.detach().clone()
            grads = _named_grads(model)
            if timing:
                for _ in range(2):
                    t0 = time.perf_counter()
                    clipper.backward(prep.loss_fn(model, prep.batch))
                    steps.append(time.perf_counter() - t0)
            clipper.remove()
        except PairTimeout:
            raise
        except Exception as err:  # noqa: BLE001  (classified)
            if clipper is not None:
                try:
                    clipper.remove()
                except Exception:  # noqa: BLE001  (already reported by the first error)
                    pass
            if steps:  # the first step went through: a later failure is no refusal
                run.outcome = "unclear"
                run.detail = f"step {len(steps) + 1} failed after a first step: {_short(err)} (at {_where(err)})"
                return run
            return _classify_error(run, err, model)
    if timing:
        run.plain_s = _time_plain(prep)
        run.first_s = steps[0]
        run.steady_s = sorted(steps[1:])[len(steps[1:]) // 2]
    return _compare(run, prep, got_norms, grads, rel)


def _classify_error(run: Run, err: BaseException, model) -> Run:
    inside = _raised_by_hf_dp(err)
    if isinstance(err, REFUSAL_TYPES) and inside:
        touched = [n for n, p in model.named_parameters() if p.grad is not None]
        message = " ".join(str(err).split())
        if touched:
            run.outcome, run.worst = "wrong", f"refusal left p.grad on {len(touched)} parameter(s), e.g. {touched[0]}"
            run.detail = f"refused: {message[:300]}"
            return run
        run.outcome, run.detail = "refused", message[:400]
        run.worst = named_module(message, model)
        return run
    run.outcome = "unclear"
    run.detail = f"{_short(err)} (at {_where(err)}{'' if inside else '; not raised by hf_dp'})"
    return run


def named_module(message: str, model) -> str:
    """The longest module name (dotted path or class name) the message mentions, or ``""``."""
    best = ""
    for name, module in model.named_modules():
        for cand in (name, type(module).__name__):
            if len(cand) > len(best) and len(cand) > 3 and cand in message:
                best = cand
    return best


def _compare(run: Run, prep: Prepared, got_norms: torch.Tensor, grads: dict, rel: float) -> Run:
    expected = prep.norms
    got = got_norms.double()
    if got.shape != expected.shape:
        run.outcome, run.worst = "wrong", f"per_example_norms shape {tuple(got.shape)}"
        return run
    norm_err = float(((got - expected).abs() / expected.abs().clamp_min(1e-300)).max())
    scale = float(torch.sqrt(sum((g**2).sum() for g in prep.clipped_sum.values())))
    bad = []
    for name in prep.names:
        e = prep.clipped_sum[name]
        g = grads.get(name)
        g = torch.zeros_like(e) if g is None else g.double()
        err = float((g - e).norm())
        en = float(e.norm())
        if err > rel * en + (1e-9 if prep.dtype == torch.float64 else 1e-6) * scale:  # round-off of zero grads
            ratio = float(g.norm()) / en if en > 0 else float("inf")
            bad.append((err / en if en > 0 else float("inf"), name, ratio, grads.get(name) is None))
    if norm_err <= rel and not bad:
        return run
    if norm_err <= rel and prep.dtype == torch.float64:
        second = _weighted_oracle(prep)
        agree = []
        for _, name, _, _ in bad:
            g = grads.get(name)
            g = torch.zeros_like(second[name]) if g is None else g.double()
            en = float(second[name].norm())
            agree.append(float((g - second[name]).norm()) <= rel * en + 1e-9 * scale)
        if all(agree):  # the engine is one exact computation of the clipped sum, the per-example loop another
            spread = max(
                float((second[n] - prep.clipped_sum[n]).norm()) / max(float(prep.clipped_sum[n].norm()), 1e-300)
                for _, n, _, _ in bad
            )
            worst = max(bad)[1]
            run.detail = (
                f"float32 inside the model: {len(bad)} parameter(s) (e.g. {worst}) equal autograd's backward of "
                f"sum_i c_i L_i to {rel:g}; the per-example oracle differs from that backward by {spread:.1e} "
                "(relative)"
            )
            return run
    run.outcome = "wrong"
    notes = [f"norms max rel err {norm_err:.1e} (median engine/oracle {float((got / expected).median()):.4g})"]
    if bad:
        bad.sort(reverse=True)
        rel_err, name, ratio, missing = bad[0]
        run.worst, run.ratio, run.rel_err = name + (" (no grad)" if missing else ""), ratio, rel_err
        others = ", ".join(f"{n} {r:.3g}x" for _, n, r, _ in bad[1:4])
        notes.append(f"{len(bad)} wrong parameter(s)" + (f"; next: {others}" if others else ""))
    else:
        run.worst = "per-example norms only"
    run.detail = "; ".join(notes)
    return run


def _weighted_oracle(prep: Prepared) -> dict[str, torch.Tensor]:
    """The clipped sum as plain autograd computes it in one backward pass: ``d/dθ sum_i c_i L_i`` with the oracle's
    own clip factors ``c_i``, on a float64 copy (no hf_dp). It equals the per-example loop's ``sum_i c_i g_i`` in exact
    arithmetic; a model that computes parts in float32 inside makes the two differ by that part's round-off, and
    an engine that matches either one is exact. Cached on ``prep``."""
    if "weighted" not in prep.extras:
        ref = copy.deepcopy(prep.model).double()
        coef = clip_factors(prep.norms, prep.max_grad_norm)
        with _with_dtype(torch.float64):
            ref.zero_grad(set_to_none=True)
            (prep.loss_fn(ref, prep.batch) * coef).sum().backward()
        names = dict(ref.named_parameters())
        prep.extras["weighted"] = {
            n: (torch.zeros_like(names[n]) if names[n].grad is None else names[n].grad.detach().double())
            for n in prep.names
        }
    return prep.extras["weighted"]


def variants_for(task: str, model_type: str, wanted: Sequence[str]) -> list[str]:
    out = []
    for v in wanted:
        if v == "lora" and task not in ("causal-lm", "seq2seq"):
            continue
        out.append(v)
    return out


def sweep_pair(
    task: str,
    model_type: str,
    modes: Sequence[str] | dict[str, Sequence[str]] = ("bk-mixopt",),
    variants: Sequence[str] = ("default", "eager"),
    *,
    timing: bool = False,
    timeout_s: int = 300,
) -> Iterator[Run]:
    """Every (mode, variant) run of one pair (a variant that cannot be built yields one ``skipped`` run).

    ``modes``: the modes of every variant, or ``{variant: modes}``; the oracle is computed once per variant."""
    default_attn = None
    moe = None
    for variant in variants_for(task, model_type, variants):
        _alarm(timeout_s)
        try:
            if variant == "eager" and default_attn == "eager":
                continue  # the default already is eager: the same run twice
            if variant in ("fp32", "experts-eager") and moe is False:
                continue
            try:
                prep = prepare(task, model_type, variant)
            except NotMoE:
                continue
            except PairTimeout as err:
                yield Run(task, model_type, "-", variant, "skipped", f"oracle: {err}")
                continue
            except (Skip, TooLarge) as err:
                yield Run(task, model_type, "-", variant, "skipped", str(err))
                continue
            except Exception as err:  # noqa: BLE001  (recorded)
                yield Run(task, model_type, "-", variant, "skipped", f"{_short(err, 200)} (at {_where(err)})")
                continue
            if variant == "default":
                default_attn = getattr(prep.model.config, "_attn_implementation", None)
                moe = prep.family == "MoE"
            if variant == "fp32" and prep.family != "MoE":
                continue
            for mode in modes.get(variant, ()) if isinstance(modes, dict) else modes:
                try:
                    yield run_mode(prep, task, model_type, mode, variant, timing=timing)
                except PairTimeout as err:
                    yield Run(task, model_type, mode, variant, "unclear", f"engine: {err}", family=prep.family)
            del prep
        finally:
            signal.alarm(0) if hasattr(signal, "SIGALRM") else None
            gc.collect()


def all_pairs(tasks: Sequence[str] | None = None, types: Sequence[str] | None = None) -> list[tuple[str, str]]:
    pairs = []
    for task in tasks or TASKS:
        for model_type in sorted(task_types(task)):
            if types is None or model_type in types:
                pairs.append((task, model_type))
    return pairs


def quiet_transformers() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
