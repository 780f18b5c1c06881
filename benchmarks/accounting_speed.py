"""Speed of the accountants: epsilon for up to 100,000 steps (first call and cached), and calibration.

python benchmarks/accounting_speed.py
"""

from __future__ import annotations

import os
import platform
import time

from hf_dp.accounting import epsilon, noise_multiplier
from hf_dp.accounting.analysis.prv import prv_errors


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def main():
    print(f"# machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}")
    delta = 1e-5
    for steps, q in [(1_000, 0.01), (10_000, 0.01), (100_000, 0.001), (100_000, 0.01)]:
        for name in ["rdp", "gdp", "prv"]:
            eps, first = timed(epsilon, 1.0, q, steps, delta, name)
            _, again = timed(epsilon, 1.0, q, steps - 1, delta, name)
            extra = ""
            if name == "prv":
                eps_error, delta_error = prv_errors(1 << (steps - 1).bit_length(), delta)
                extra = f"\teps_error={eps_error:.3g} delta_error={delta_error:.1e}"
            print(f"epsilon\t{name}\tsteps={steps}\tq={q}\teps={eps:.4f}\tfirst={first:.3f}s\tnext={again:.3f}s{extra}")
    for steps, q in [(1_000, 0.01), (10_000, 0.01), (100_000, 0.001)]:
        for name in ["rdp", "gdp", "prv"]:
            sigma, took = timed(noise_multiplier, 3.0, delta, q, steps, name)
            check = epsilon(sigma, q, steps, delta, name)
            print(f"calibrate\t{name}\tsteps={steps}\tq={q}\tsigma={sigma:.4f}\teps={check:.4f}\ttime={took:.2f}s")


if __name__ == "__main__":
    main()
