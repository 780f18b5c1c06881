"""The PEFT sweep (issue 38): every tuner peft can build, on tiny float64 GPT-2, Llama, BERT and T5, against the
float64 per-example oracle, with the engine alone (``BookKeepingClipper``, no self-check).

One *run* is ``(tuner, model, mode)``; the tuners and their tiny configs are in ``tuners.py``. Each run is

* ``exact``: every per-example total norm and every trainable parameter's clipped sum (relative to that parameter's
  own norm) within 1e-6 of the oracle;
* ``refused``: hf_dp raised ``UnsupportedModuleError`` / ``ValueError`` / ``NotImplementedError`` itself (the
  traceback's last frame is inside the installed ``hf_dp`` package), the message names a module path of the model,
  and every ``p.grad`` is as it was;
* ``wrong``: no error, but numbers that differ (the worst parameter and its engine/oracle norm ratio), or a refusal
  that left something in ``p.grad``;
* ``unclear``: a refusal by hf_dp that names no module path, or any other exception while the engine ran;
* ``skipped``: peft cannot build the tuner on that model, or the PEFT model cannot run without the engine (peft's
  error is recorded), or its per-example norms are degenerate.

The batch is the first micro-batch of ``tests/helpers/models.py`` for the model's task (padded rows, 4 or 5
examples); the loss is hf_dp's per-example loss of the task (next-token cross-entropy summed over the example's
tokens, with the logits of virtual tokens that prompt learning prepends dropped; cross-entropy of the class; the
decoder's token cross-entropy). Every trainable parameter is moved off its initialisation (peft starts many deltas
at zero, which would hide the gradients of the factors before them); ``C`` is the median per-example norm.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
for _path in (_TESTS, os.path.join(_TESTS, "peers")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
from harness import _raised_by_hf_dp  # noqa: E402
from helpers.oracle import clip_factors  # noqa: E402

from hf_dp import BookKeepingClipper  # noqa: E402
from hf_dp.losses import causal_lm_loss, sequence_classification_loss, token_loss  # noqa: E402

from .tuners import DEFAULT_DTYPE, MODELS, TUNERS, ModelSpec  # noqa: E402

MODES = ("bk-mixopt", "bk", "ghost")
OUTCOMES = ("exact", "refused", "wrong", "unclear", "skipped")
REFUSAL_TYPES = (ValueError, NotImplementedError)  # UnsupportedModuleError is a ValueError
REL = 1e-6


@dataclass
class Run:
    """The outcome of one (tuner, model, mode); ``mode`` is ``"-"`` for a tuner that could not be built."""

    tuner: str
    model: str
    mode: str
    outcome: str
    detail: str = ""
    worst: str = ""  # the worst parameter (wrong) or the module path the refusal names
    ratio: float | None = None  # ||engine|| / ||oracle|| of the worst parameter
    rel_err: float | None = None
    seconds: float | None = None  # the engine's step (construction + forward + clipper.backward)

    def line(self) -> str:
        text = f"{self.outcome:8s} {self.tuner:26s} {self.model:6s} {self.mode:10s}"
        if self.worst:
            ratio = f" {self.ratio:.3g}x" if self.ratio is not None else ""
            err = f" (rel err {self.rel_err:.1e})" if self.rel_err is not None else ""
            text += f" worst={self.worst}{ratio}{err}"
        if self.seconds is not None:
            text += f" {self.seconds:.2f}s"
        if self.detail:
            text += f" | {self.detail}"
        return text


class Skip(Exception):
    """The tuner cannot be built or run on the model without the engine."""


class PairTimeout(Exception):
    pass


def _short(err: BaseException, n: int = 300) -> str:
    return f"{type(err).__name__}: " + " ".join(str(err).split())[:n]


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)[-2:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


class _default_dtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __enter__(self):
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.previous)


# ----------------------------------------------------------------------------------------------------- the loss
def make_loss(spec: ModelSpec, forward_kwargs: dict) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    """``loss_fn(model, batch) -> [B]`` for the model's task (the same draws in the oracle and the engine)."""

    def loss_fn(model, batch):
        torch.manual_seed(7)  # dropout in a tuner draws the same masks in the oracle and the engine
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        inputs.update({k: (v(batch) if callable(v) else v) for k, v in forward_kwargs.items()})
        out = model(**inputs)
        labels = batch["labels"]
        if spec.task_type == "SEQ_CLS":
            return sequence_classification_loss(out.logits, labels)
        logits = out.logits[:, -labels.shape[1] :]  # prompt learning prepends virtual tokens: keep the real positions
        if spec.task_type == "CAUSAL_LM":
            return causal_lm_loss(logits, labels, reduction="sum")
        return token_loss(logits, labels, reduction="sum")

    return loss_fn


# ------------------------------------------------------------------------------------------------ one (tuner, model)
@dataclass
class Prepared:
    """One (tuner, model): its batch and loss, the oracle's answer, and the trainable state it was computed on."""

    tuner: str
    model_name: str
    batch: dict
    loss_fn: Callable
    names: list[str]
    norms: torch.Tensor
    clipped_sum: dict[str, torch.Tensor]
    max_grad_norm: float
    state: dict[str, torch.Tensor]
    dtype: torch.dtype
    loss: torch.Tensor  # the plain forward's per-example losses
    extras: dict = field(default_factory=dict)


def build(tuner: str, model_name: str) -> tuple[torch.nn.Module, dict, Callable]:
    """The float64 PEFT model (trainable parameters moved off their initialisation), its batch and its loss;
    raises ``Skip`` with peft's error when peft cannot build the tuner on the model. Deterministic: every run builds
    its own model, because ``copy.deepcopy`` drops the hooks a tuner registers on its parameters (OSF's gradient
    projection), and the oracle and the engine must both see them."""
    import peft

    spec = MODELS[model_name]
    _, builder = TUNERS[tuner]
    with _default_dtype(torch.float64), tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        base = spec.build().double()
        batch = dict(spec.batch())
        if spec.task_type == "SEQ_2_SEQ_LM":
            batch["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        try:
            config, forward_kwargs = builder(spec, base, tmp)
            torch.manual_seed(1)
            model = peft.get_peft_model(base, config)
        except Exception as err:  # noqa: BLE001  (recorded: peft cannot build this tuner here)
            raise Skip(f"peft: {_short(err, 240)} (at {_where(err)})") from err
    model = model.double()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise Skip("peft left no trainable parameter")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in trainable:  # zero-initialised deltas would hide the gradients of the factors before them
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.train()
    return model, batch, make_loss(spec, forward_kwargs)


def prepare(tuner: str, model_name: str) -> Prepared:
    """Build the model and the oracle's answer; raises ``Skip`` when it cannot be built or run."""
    model, batch, loss_fn = build(tuner, model_name)
    dtype = DEFAULT_DTYPE.get(tuner, torch.float64)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with _default_dtype(dtype):
            names, grads, loss = _oracle(model, batch, loss_fn)
    except Exception as err:  # noqa: BLE001  (the PEFT model does not run without the engine)
        raise Skip(f"oracle: {_short(err, 240)} (at {_where(err)})") from err
    norms = torch.stack([torch.sqrt(sum((g.double() ** 2).sum() for g in gi)) for gi in grads])
    if not bool(torch.isfinite(norms).all()) or float(norms.max()) == 0:
        raise Skip(f"degenerate per-example norms {norms.tolist()}")
    c = float(norms[norms > 0].median())  # some examples clipped, some not (and C > 0 where some norms are 0)
    if not bool((norms > c).any()):
        raise Skip(f"degenerate per-example norms {norms.tolist()}")
    coef = clip_factors(norms, c)
    clipped = {n: sum(coef[i] * grads[i][k].double() for i in range(len(grads))) for k, n in enumerate(names)}
    return Prepared(tuner, model_name, batch, loss_fn, names, norms, clipped, c, state, dtype, loss)


def _oracle(model, batch, loss_fn) -> tuple[list[str], list[list[torch.Tensor]], torch.Tensor]:
    """``tests/helpers/oracle.py``'s per-example loop, on ``model`` itself (``oracle_clipped`` differentiates a deep
    copy, which has lost the hooks on its parameters), and the per-example losses of its forward."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = loss_fn(model, batch)
    grads = []
    for i in range(loss.shape[0]):
        g = torch.autograd.grad(loss[i], [p for _, p in named], retain_graph=True, allow_unused=True)
        grads.append([torch.zeros_like(p) if gi is None else gi for gi, (_, p) in zip(g, named, strict=True)])
    return [n for n, _ in named], grads, loss.detach()


def _rebuild(prep: Prepared) -> torch.nn.Module:
    """A fresh model for one run, checked equal to the one the oracle differentiated."""
    model, _, _ = build(prep.tuner, prep.model_name)
    for n, p in model.named_parameters():
        if not torch.equal(p.detach(), prep.state[n]):
            raise RuntimeError(f"the sweep rebuilt {prep.tuner} on {prep.model_name} differently: {n}")
    return model


def run_mode(prep: Prepared, mode: str) -> Run:
    """One engine run (the engine alone: no self-check) against the prepared oracle."""
    run = Run(prep.tuner, prep.model_name, mode, "exact")
    model = _rebuild(prep)
    clipper = None
    with _default_dtype(prep.dtype):
        try:
            t0 = time.perf_counter()
            clipper = BookKeepingClipper(model, max_grad_norm=prep.max_grad_norm, mode=mode)
            loss = prep.loss_fn(model, prep.batch)
            clipper.backward(loss)
            run.seconds = time.perf_counter() - t0
            got_norms = clipper.per_example_norms.detach().clone()
            grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
            clipper.remove()
        except PairTimeout:
            raise
        except Exception as err:  # noqa: BLE001  (classified)
            if clipper is not None:
                try:
                    clipper.remove()
                except Exception:  # noqa: BLE001  (the first error is the one reported)
                    pass
            return classify_error(run, err, model)
    moved = float(((loss.detach() - prep.loss).abs() / prep.loss.abs().clamp_min(1e-300)).max())
    if moved > REL:  # the same seed, another forward: the oracle's gradients are of another loss
        run.outcome = "unclear"
        run.detail = (
            f"the forward with the engine's hooks gives other per-example losses than the plain forward with the same "
            f"seed (max rel diff {moved:.1e}): the engine changed the model's random draws or its output"
        )
        return run
    return compare(run, prep, got_norms, grads)


def named_module_path(message: str, model: torch.nn.Module) -> str:
    """The longest module path of ``model`` (a dotted name) that ``message`` mentions, or ``""``."""
    best = ""
    for name, _ in model.named_modules():
        if "." in name and len(name) > len(best) and name in message:
            best = name
    return best


def classify_error(run: Run, err: BaseException, model: torch.nn.Module) -> Run:
    message = " ".join(str(err).split())
    if isinstance(err, REFUSAL_TYPES) and _raised_by_hf_dp(err):
        touched = [n for n, p in model.named_parameters() if p.grad is not None]
        if touched:
            run.outcome, run.worst = "wrong", f"refusal left p.grad on {len(touched)} parameter(s), e.g. {touched[0]}"
            run.detail = f"refused: {message[:300]}"
            return run
        run.worst = named_module_path(message, model)
        run.outcome = "refused" if run.worst else "unclear"
        run.detail = message[:400] if run.worst else f"refused without a module path: {message[:400]}"
        return run
    inside = _raised_by_hf_dp(err)
    run.outcome = "unclear"
    run.detail = f"{_short(err)} (at {_where(err)}{'' if inside else '; not raised by hf_dp'})"
    return run


def compare(run: Run, prep: Prepared, got_norms: torch.Tensor, grads: dict) -> Run:
    """Per-example norms elementwise, then each parameter's clipped sum relative to its own norm."""
    expected, got = prep.norms, got_norms.double()
    if got.shape != expected.shape:
        run.outcome, run.worst = "wrong", f"per_example_norms shape {tuple(got.shape)}"
        return run
    norm_err = float(((got - expected).abs() / expected.abs().clamp_min(1e-300)).max())
    bad = _bad_parameters(prep, prep.clipped_sum, grads)
    if norm_err <= REL and not bad:
        return run
    if norm_err <= REL and not set(bad) & set(_bad_parameters(prep, _weighted_oracle(prep), grads)):
        # each parameter off the loop's sum_i c_i g_i equals autograd's backward of sum_i c_i L_i (float32 inside)
        run.detail = f"float32 inside the tuner: {len(bad)} parameter(s) equal the one-backward oracle to {REL:g}"
        return run
    run.outcome = "wrong"
    notes = [f"norms max rel err {norm_err:.1e} (median engine/oracle {float((got / expected).median()):.4g})"]
    if bad:
        ranked = sorted(((e, n, r, m) for n, (e, r, m) in bad.items()), reverse=True)
        rel_err, name, ratio, missing = ranked[0]
        run.worst, run.ratio, run.rel_err = name + (" (no grad)" if missing else ""), ratio, rel_err
        others = ", ".join(f"{n} {r:.3g}x" for _, n, r, _ in ranked[1:4])
        notes.append(f"{len(bad)} wrong parameter(s)" + (f"; next: {others}" if others else ""))
    else:
        run.worst = "per-example norms only"
    run.detail = "; ".join(notes)
    return run


def _bad_parameters(prep: Prepared, reference: dict, grads: dict) -> dict[str, tuple[float, float, bool]]:
    """``name -> (relative error, engine/oracle norm ratio, no grad)`` of the parameters off ``reference``."""
    scale = float(torch.sqrt(sum((g**2).sum() for g in reference.values())))
    bad = {}
    for name in prep.names:
        e = reference[name]
        g = grads.get(name)
        g = torch.zeros_like(e) if g is None else g.double()
        err, en = float((g - e).norm()), float(e.norm())
        if err > REL * en + 1e-9 * scale:  # the floor: round-off of gradients that are zero in theory
            ratio = float(g.norm()) / en if en > 0 else float("inf")
            bad[name] = (err / en if en > 0 else float("inf"), ratio, grads.get(name) is None)
    return bad


def _weighted_oracle(prep: Prepared) -> dict[str, torch.Tensor]:
    """The clipped sum as plain autograd forms it in one backward: ``d/dθ sum_i c_i L_i`` with the oracle's clip
    factors, on a fresh build. Equal to the loop's ``sum_i c_i g_i`` in exact arithmetic; a tuner that computes in
    float32 inside makes the two differ by its round-off, and an engine that matches either one is exact."""
    if "weighted" not in prep.extras:
        ref = _rebuild(prep)
        coef = clip_factors(prep.norms, prep.max_grad_norm)
        with _default_dtype(prep.dtype):
            ref.zero_grad(set_to_none=True)
            (prep.loss_fn(ref, prep.batch) * coef).sum().backward()
        params = dict(ref.named_parameters())
        prep.extras["weighted"] = {
            n: torch.zeros_like(params[n]) if params[n].grad is None else params[n].grad.detach().double()
            for n in prep.names
        }
    return prep.extras["weighted"]


# ------------------------------------------------------------------------------------------------------- the sweep
def _alarm(seconds: int) -> None:
    def handler(signum, frame):
        raise PairTimeout(f"took more than {seconds} s")

    if seconds and hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, handler)
        signal.alarm(seconds)


def sweep_pair(tuner: str, model_name: str, modes: Sequence[str] = MODES, *, timeout_s: int = 300) -> Iterator[Run]:
    """Every mode of one (tuner, model); one ``skipped`` run when it cannot be built or run."""
    _alarm(timeout_s)
    try:
        try:
            prep = prepare(tuner, model_name)
        except (Skip, PairTimeout) as err:
            yield Run(tuner, model_name, "-", "skipped", str(err))
            return
        except Exception as err:  # noqa: BLE001  (recorded)
            yield Run(tuner, model_name, "-", "skipped", f"{_short(err, 240)} (at {_where(err)})")
            return
        for mode in modes:
            try:
                yield run_mode(prep, mode)
            except PairTimeout as err:
                yield Run(tuner, model_name, mode, "unclear", f"engine: {err}")
    finally:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)
        gc.collect()


def all_pairs(tuners: Sequence[str] | None = None, models: Sequence[str] | None = None) -> list[tuple[str, str]]:
    return [(t, m) for t in (tuners or TUNERS) for m in (models or MODELS)]


def quiet() -> None:
    """No warnings or transformers/peft logging; never the Hub."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
