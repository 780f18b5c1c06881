"""Print the outcome of every peer configuration against today's engine (a table for the issue).

    OMP_NUM_THREADS=1 .venv/bin/python tests/peers/report.py [substring ...]

Each row: configuration, clipping mode, ``exact`` / ``refused(<message>)`` / ``WRONG(<rel err>)`` / ``CRASH(...)``,
and whether that outcome is acceptable for the configuration. ``--gaps`` instead lists the differences from
``known_gaps.KNOWN_GAPS`` (failing rows it lacks, entries whose rows now pass); ``--summary`` prints one row per
configuration.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

from harness import EXACT, MODES, REFUSED, node_id, reference, run_case  # noqa: E402

MODULES = (
    "test_opacus_grad_sample_spaces",
    "test_fastdp_layers",
    "test_private_transformers_models",
    "test_silent_classes",
)


def outcomes(filters: list[str]):
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for config_id, case in module.CONFIGS.items():
            if filters and not any(f in config_id for f in filters):
                continue
            start = time.perf_counter()
            try:
                ref = reference(case)
            except Exception as err:  # noqa: BLE001  (a report, not a test)
                for mode in MODES:
                    yield module_name, config_id, mode, f"ORACLE-FAIL({type(err).__name__}: {err})", case
                continue
            for mode in MODES:
                try:
                    out = run_case(case, mode, ref=ref)
                except AssertionError as err:
                    out = str(err)
                except Exception as err:  # noqa: BLE001
                    out = f"CRASH({type(err).__name__}: {' '.join(str(err).split())[:160]})"
                yield module_name, config_id, mode, out, case
            print(f"# {config_id}: {time.perf_counter() - start:.2f}s", file=sys.stderr)


def short(out: str) -> str:
    """``exact`` / ``refused(<first words>)`` / ``WRONG(<rel err>)`` / ``GRAPH`` / ``CRASH(<type>)``."""
    if out.startswith(REFUSED):
        return f"refused({' '.join(out[len(REFUSED) :].split()[:12])} ...)"
    if out.startswith("WRONG"):
        return out[: out.index(")") + 1]
    if out.startswith("GRAPH"):
        return "GRAPH (exact numbers, p.grad has a graph)"
    if out.startswith("CRASH"):
        return out[: out.index(":")] + ")"
    return out


def acceptable(out: str, case) -> bool:
    return out == EXACT or (case.refusable is not None and out.startswith(REFUSED))


def main() -> None:
    args = sys.argv[1:]
    filters = [a for a in args if not a.startswith("--")]
    rows = list(outcomes(filters))
    if "--gaps" in args:  # compare with KNOWN_GAPS: failing rows not listed, listed rows that now pass
        from known_gaps import KNOWN_GAPS

        failing: dict[str, set[str]] = {}
        for _, config_id, mode, out, case in rows:
            if not acceptable(out, case):
                failing.setdefault(config_id, set()).add(mode)
        for _, config_id, mode, out, _case in rows:
            tid = node_id(config_id, mode)
            listed = tid in KNOWN_GAPS or config_id in KNOWN_GAPS
            bad = mode in failing.get(config_id, set())
            if bad and not listed:
                key = config_id if failing[config_id] == set(MODES) else tid
                print(f"missing from KNOWN_GAPS: {key!r}: {out[:100]!r}")
            elif listed and not bad:
                print(f"stale KNOWN_GAPS entry (now {out[:40]}): {tid if tid in KNOWN_GAPS else config_id!r}")
        return
    if "--summary" in args:  # one row per configuration, outcomes collapsed over modes
        by_config: dict[tuple[str, str], list[tuple[str, str, bool]]] = {}
        for module_name, config_id, mode, out, case in rows:
            by_config.setdefault((module_name, config_id), []).append((mode, short(out), acceptable(out, case)))
        for (module_name, config_id), results in by_config.items():
            shown = {r for _, r, _ in results}
            text = shown.pop() if len(shown) == 1 else ", ".join(f"{m}: {r}" for m, r, _ in results)
            ok = "ok" if all(a for _, _, a in results) else "GAP"
            print(f"| {module_name.removeprefix('test_')} | {config_id} | {text} | {ok} |")
        return
    for module_name, config_id, mode, out, case in rows:
        shown = f"refused({out[len(REFUSED) :][:150]})" if out.startswith(REFUSED) else out[:200]
        ok = "ok" if acceptable(out, case) else "GAP"
        print(f"| {module_name.removeprefix('test_')} | {config_id} | {mode} | {shown} | {ok} |")


if __name__ == "__main__":
    main()
