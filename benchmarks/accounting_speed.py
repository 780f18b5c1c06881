"""Accountants side by side: epsilon and time of hf_dp's PRV and RDP, Opacus's PRV and dp-accounting's PLD (its
default grid, 1e-4), for 1e3 to 1e6 steps; then the time to calibrate sigma.

Each line is one measurement. ``first`` is the first call for a setting (nothing cached); ``next`` asks for one more
step, as the trainer does at every logging step. Opacus and dp-accounting keep no cache, so their ``next`` is another
full computation. Opacus's PRV is skipped where its grid would exceed ``OPACUS_MAX_POINTS`` (memory).

    OMP_NUM_THREADS=1 python benchmarks/accounting_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
import warnings

from hf_dp.accounting import epsilon, noise_multiplier
from hf_dp.accounting.analysis import prv, rdp

#: (sample rate, noise multiplier): the issue's long run, a typical fine-tuning setting, a large-batch one.
SETTINGS = [(1e-5, 0.433), (1e-3, 1.0), (1e-2, 2.0)]
STEPS = [1_000, 10_000, 100_000, 1_000_000]
DELTAS = [1e-5, 1e-8]
OPACUS_MAX_POINTS = 2e7


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def clear_hf_dp_caches():
    for cached in (prv._refine, prv._composed, prv._step_pmf, rdp._rdp_one_step):
        cached.cache_clear()


def hf_dp(name):
    def compute(sigma, q, steps, delta):
        return epsilon(sigma, q, steps, delta, name)

    return compute


def opacus_prv(sigma, q, steps, delta):
    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    accountant.history = [(sigma, q, steps)]
    return float(accountant.get_epsilon(delta))


def opacus_points(sigma, q, steps, delta):
    """Size of Opacus's PRV grid (its ``_get_domain``: 2L / mesh, L from RDP)."""
    eps_error, delta_error = 0.01, delta / 1000
    length = max(epsilon(sigma, q, steps, delta_error / 4, "rdp"), eps_error) + 3
    mesh = eps_error / math.sqrt(steps * math.log(12 / delta_error) / 2)
    return 2 * length / mesh


def pld(sigma, q, steps, delta):
    import dp_accounting

    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return float(accountant.get_epsilon(delta))


METHODS = {"hf_dp-prv": hf_dp("prv"), "hf_dp-rdp": hf_dp("rdp"), "opacus-prv": opacus_prv, "dp_accounting-pld": pld}


def measure_epsilon(q, sigma, steps, delta):
    for name, compute in METHODS.items():
        setting = f"q={q:g}\tsigma={sigma:g}\tsteps={steps}\tdelta={delta:g}\t{name}"
        if name == "opacus-prv" and opacus_points(sigma, q, steps, delta) > OPACUS_MAX_POINTS:
            print(f"epsilon\t{setting}\tskipped (grid of {opacus_points(sigma, q, steps, delta):.2g} points)")
            continue
        clear_hf_dp_caches()
        value, first = timed(compute, sigma, q, steps, delta)
        _, again = timed(compute, sigma, q, steps + 1, delta)
        print(f"epsilon\t{setting}\teps={value:.4f}\tfirst={first:.2f}s\tnext={again:.2f}s", flush=True)


def measure_calibration(q, steps, delta, target=3.0):
    for name in ("prv", "rdp"):
        clear_hf_dp_caches()
        sigma, took = timed(noise_multiplier, target, delta, q, steps, name)
        check = epsilon(sigma, q, steps, delta, name)
        print(
            f"calibrate\tq={q:g}\tsteps={steps}\tdelta={delta:g}\ttarget={target:g}\thf_dp-{name}\tsigma={sigma:.4f}"
            f"\teps={check:.4f}\ttime={took:.2f}s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one setting, up to 1e5 steps")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"# {platform.machine()}, {os.cpu_count()} cpus, load {load}, python {platform.python_version()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    settings, steps_list = (SETTINGS[:1], STEPS[:3]) if args.quick else (SETTINGS, STEPS)
    for q, sigma in settings:
        for steps in steps_list:
            for delta in DELTAS:
                measure_epsilon(q, sigma, steps, delta)
    for q, _ in settings:
        for steps in steps_list:
            measure_calibration(q, steps, DELTAS[0])
    print(f"# load at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
