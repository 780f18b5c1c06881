"""Run one peer configuration against ``BookKeepingClipper`` and classify the outcome.

A configuration is a model factory, its micro-batches and a per-example loss. The float64 oracle of
``tests/helpers/oracle.py`` (one autograd call per example) gives the reference norms and the accumulated clipped sum;
the engine then runs on a fresh copy of the same model. The outcome is

* ``"exact"``: every per-example norm within ``rel`` (elementwise) and every parameter's accumulated clipped sum
  within ``rel`` (relative to its norm, with the oracle's round-off floor);
* ``"refused: <message>"``: hf_dp raised ``UnsupportedModuleError``/``ValueError`` itself, at construction or in the
  first micro-batch (a refusal that comes later, after a step was taken, is not a refusal but a failure);
* an ``AssertionError`` naming the relative error when the engine returned numbers that are wrong: the silent class
  (``"WRONG ..."``), or, with exact numbers, when ``p.grad`` carries an autograd graph (``"GRAPH ..."``, DESIGN 16).

Anything else (a crash inside torch or transformers) propagates.
"""

from __future__ import annotations

import copy
import math
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from helpers.oracle import oracle_clipped
from torch import Tensor, nn

import hf_dp
from hf_dp import BookKeepingClipper

MODES = ("bk", "bk-mixopt", "per-sample", "ghost")
EXACT = "exact"
REFUSED = "refused: "
LossFn = Callable[[nn.Module, dict], Tensor]
_HF_DP_PACKAGE = os.path.dirname(os.path.abspath(hf_dp.__file__)) + os.sep  # the package, not any folder named hf_dp


@dataclass(frozen=True)
class Case:
    """One configuration.

    Args:
        build: returns the model (random init; the caller seeds and converts to float64).
        batches: returns the micro-batches (accumulated into one clipped sum).
        loss_fn: ``(model, batch) -> [B]`` per-example loss.
        refusable: why a clear refusal is an acceptable outcome (batch-second layout, BatchNorm, a layer the issue
            does not require); ``None``: the configuration must be exact.
    """

    build: Callable[[], nn.Module]
    batches: Callable[[], list[dict]]
    loss_fn: LossFn
    refusable: str | None = None


def projection(shape: Sequence[int], seed: int, dtype: torch.dtype) -> Tensor:
    """A fixed random tensor of ``shape`` (the same on every call, independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def project(y: Tensor, batch_dim: int = 0) -> Tensor:
    """Per-example loss ``<R1, y_i> + 0.5 ||R2 * y_i||^2 + 0.5 <R3, y_i>^2 / n`` with fixed random ``R1, R2, R3``.

    The quadratic terms make the output gradient differ between examples (a linear loss alone would give every
    example the same one), the last one through the whole example (so that even an output position that copies a
    parameter gets a per-example gradient). ``batch_dim`` says where the examples are (1 for ``[T, B, d]`` layouts).
    """
    y = y.movedim(batch_dim, 0)
    r1, r2, r3 = (projection(y.shape[1:], seed, y.dtype) for seed in (1, 2, 3))
    dims = tuple(range(1, y.dim()))
    n = max(1, math.prod(y.shape[1:]))
    return (y * r1).sum(dims) + 0.5 * ((y * r2) ** 2).sum(dims) + 0.5 * (y * r3).sum(dims) ** 2 / n


def _raised_by_hf_dp(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_HF_DP_PACKAGE)


def _refusal(err: BaseException) -> str:
    return REFUSED + " ".join(str(err).split())


@dataclass
class Reference:
    """The oracle's answer for one configuration, shared by every clipping mode."""

    model: nn.Module
    batches: list[dict]
    names: list[str]
    norms: list[Tensor]  # one per non-empty micro-batch
    clipped_sum: dict[str, Tensor]
    max_grad_norm: float
    sizes: list[int]  # examples per micro-batch (0: an empty micro-batch, which must change nothing)


def reference(case: Case, seed: int = 0) -> Reference:
    """Build the model (float64, train mode, seeded) and its oracle norms and clipped sum (``C`` = median norm)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        model = case.build().double().train()
        batches = case.batches()
        with torch.no_grad():
            probe = copy.deepcopy(model)
            sizes = [int(case.loss_fn(probe, batch).shape[0]) for batch in batches]
        nonempty = [batch for batch, n in zip(batches, sizes, strict=True) if n > 0]
        names, norms, clipped_sum, c = oracle_clipped(model, nonempty, case.loss_fn, None)
    finally:
        torch.set_default_dtype(previous)
    if not any(bool((n > c).any()) for n in norms):
        raise AssertionError("the configuration must clip some examples (all per-example norms are equal?)")
    return Reference(model, batches, names, norms, clipped_sum, c, sizes)


def _rel(err: float, ref: float) -> float:
    return err / ref if ref > 0 else (0.0 if err == 0 else float("inf"))


def run_case(case: Case, mode: str, *, ref: Reference | None = None, rel: float = 1e-6) -> str:
    """``"exact"`` or ``"refused: <message>"``; ``AssertionError`` with the relative error when silently wrong."""
    ref = ref if ref is not None else reference(case)
    model = copy.deepcopy(ref.model)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        try:
            clipper = BookKeepingClipper(model, max_grad_norm=ref.max_grad_norm, mode=mode)
        except ValueError as err:  # UnsupportedModuleError is a ValueError
            if _raised_by_hf_dp(err):
                return _refusal(err)
            raise
        norms = []
        for k, batch in enumerate(ref.batches):
            try:
                clipper.backward(case.loss_fn(model, batch))
            except ValueError as err:
                if not _raised_by_hf_dp(err):
                    raise
                if k > 0:
                    raise AssertionError(f"refused only at micro-batch {k}, after a step was taken: {err}") from err
                clipper.remove()
                return _refusal(err)
            got = clipper.per_example_norms
            assert got is not None and got.shape == (ref.sizes[k],), f"per_example_norms has shape {got.shape}"
            if ref.sizes[k] > 0:
                norms.append(got.detach().clone())
        clipper.remove()
    finally:
        torch.set_default_dtype(previous)
    after = {n: p.requires_grad for n, p in model.named_parameters()}
    assert after == before, "remove() did not restore requires_grad"
    return _compare(model, ref, norms, rel)


def _compare(model: nn.Module, ref: Reference, norms: list[Tensor], rel: float) -> str:
    details, graphs = [], []
    got_all, expected_all = torch.cat(norms).double(), torch.cat(ref.norms)
    norm_err = float(((got_all - expected_all).abs() / expected_all.abs().clamp_min(1e-300)).max())
    if norm_err > rel:
        details.append(f"per-example norms: median engine/oracle {float((got_all / expected_all).median()):.3f}")
    params = dict(model.named_parameters())
    scale = float(torch.sqrt(sum((g**2).sum() for g in ref.clipped_sum.values())))
    total_err_sq = 0.0
    for name in ref.names:
        expected = ref.clipped_sum[name]
        grad = params[name].grad
        missing = grad is None
        if missing:
            grad = torch.zeros_like(expected)
        elif grad.requires_grad:  # DESIGN 16: p.grad never carries an autograd graph
            graphs.append(name)
            grad = grad.detach()
        err = float((grad - expected).norm())
        total_err_sq += err**2
        if err > rel * float(expected.norm()) + 1e-12 * scale:
            what = "no gradient" if missing else f"rel err {_rel(err, float(expected.norm())):.1e}"
            details.append(f"{name}: {what}")
    sum_err = math.sqrt(total_err_sq) / scale
    graph_note = f"p.grad of {len(graphs)} parameter(s) carries an autograd graph (e.g. {graphs[0]})" if graphs else ""
    wrong_sum = any(not d.startswith("per-example") for d in details)
    if norm_err > rel or wrong_sum:
        shown = "; ".join(details[:5]) + (f"; ... {len(details) - 5} more" if len(details) > 5 else "")
        head = f"WRONG (norms max rel err {norm_err:.1e}, clipped sum rel err {sum_err:.1e})"
        raise AssertionError(f"{head}: {shown}" + (f"; {graph_note}" if graphs else ""))
    if graphs:
        raise AssertionError(f"GRAPH: numbers exact, but {graph_note} (DESIGN 16)")
    return EXACT


def check_config(config_id: str, case: Case, mode: str) -> None:
    """The test body: run ``config_id`` in ``mode`` and check the outcome; a crash becomes a short AssertionError
    naming where it happened (pytest's report of a deep torch/transformers traceback costs ~1 s per test)."""
    try:
        outcome = run_case(case, mode, ref=cached_reference(config_id, case))
    except AssertionError:
        raise
    except Exception as err:  # noqa: BLE001  (reported, not swallowed)
        frames = traceback.extract_tb(err.__traceback__)[-3:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
        message = " ".join(str(err).split())[:300]
        raise AssertionError(f"CRASH {type(err).__name__}: {message} (at {where})") from None
    check_outcome(outcome, case)


def check_outcome(outcome: str, case: Case) -> None:
    """Exact, or (only where ``case.refusable`` says so) a clear refusal by hf_dp."""
    if outcome == EXACT:
        return
    assert case.refusable is not None, f"must be exact, but {outcome}"
    assert outcome.startswith(REFUSED) and len(outcome) > len(REFUSED) + 30, f"unclear refusal: {outcome!r}"


_REFERENCES: dict[tuple[str, int], Reference] = {}


def cached_reference(config_id: str, case: Case) -> Reference:
    """The oracle for ``config_id``, computed once per session and shared by the clipping modes."""
    key = (config_id, id(case))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(case)
    return _REFERENCES[key]


def node_id(config_id: str, mode: str) -> str:
    return f"{config_id}@{mode}"


def peer_params(configs: dict[str, Case], modes: Sequence[str] = MODES) -> list:
    """``pytest.param(config_id, mode)`` for every configuration and mode; known gaps are strict xfails.

    A key of :data:`known_gaps.KNOWN_GAPS` is ``"<config>@<mode>"`` (one mode) or ``"<config>"`` (every mode).
    """
    import pytest
    from known_gaps import KNOWN_GAPS

    out = []
    for config_id in configs:
        for mode in modes:
            tid = node_id(config_id, mode)
            reason = KNOWN_GAPS.get(tid, KNOWN_GAPS.get(config_id))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(config_id, mode, id=tid, marks=marks))
    return out
