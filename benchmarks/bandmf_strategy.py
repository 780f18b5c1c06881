"""BandMF's strategy, its noise and its accounting, measured side by side.

1. The time to optimize the coefficients (nothing cached) and the workload's noise RMSE against DP-SGD's (C = I) at
   the same sigma, for prefix sums, momentum 0.9 and a linear-decay learning-rate schedule.
2. The noise the two need for the same (epsilon, delta): DP-SGD at rate q for T steps against BandMF at the part's
   rate b q for ceil(T / b) equivalent steps (the same expected batch), and the product sigma x RMSE (the noise on
   the trained parameters) for each.
3. The per-step time of the correlated noise (b - 1 fused adds of the kept rows) against NoiseSource's draw,
   interleaved, medians.

    OMP_NUM_THREADS=1 python benchmarks/bandmf_strategy.py [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from hf_dp.accounting import noise_multiplier, sigma_for_banded
from hf_dp.step.bandmf import CorrelatedNoiseSource, optimize_banded_toeplitz
from hf_dp.step.bandmf.strategy import _optimize
from hf_dp.step.noise import NoiseSource


def optimize_timed(steps: int, bands: int, **kwargs) -> tuple[float, object]:
    _optimize.cache_clear()
    start = time.perf_counter()
    strategy = optimize_banded_toeplitz(steps, bands, **kwargs)
    return time.perf_counter() - start, strategy


def strategies(quick: bool) -> None:
    print("| workload | n | b | optimize (s) | RMSE / DP-SGD's |\n|---|---|---|---|---|")
    grid = [(1000, 16), (10_000, 64)] + ([] if quick else [(100_000, 64)])
    for steps, bands in grid:
        for kwargs in ({}, {"momentum": 0.9}):
            seconds, s = optimize_timed(steps, bands, **kwargs)
            print(f"| {s.workload} | {steps} | {bands} | {seconds:.3f} | {s.error / s.dpsgd_error:.3f} |")
    rates = [1.0 - t / 2000 for t in range(2000)]
    seconds, s = optimize_timed(2000, 16, learning_rates=rates)
    print(f"| {s.workload} (linear decay) | 2000 | 16 | {seconds:.3f} | {s.error / s.dpsgd_error:.3f} |")


def noise_needed(accountant: str) -> None:
    print(f"\n| n | q | b | sigma ({accountant}) | RMSE / DP-SGD's | sigma x RMSE / DP-SGD's |")
    print("|---|---|---|---|---|---|")
    epsilon, delta = 3.0, 1e-5
    for steps, q in ((1000, 0.01), (2000, 0.002)):
        base = noise_multiplier(epsilon, delta, q, steps, accountant)
        for bands in (1, 4, 16, 64):
            if bands * q > 1:
                continue
            s = optimize_banded_toeplitz(steps, bands)
            sigma = sigma_for_banded(epsilon, delta, bands * q, steps, bands, accountant)
            ratio = s.error / s.dpsgd_error
            print(f"| {steps} | {q} | {bands} | {sigma:.3f} | {ratio:.3f} | {sigma * ratio / base:.3f} |")


def noise_time(numel: int, bands: int, repeats: int) -> None:
    shapes = [(numel // 4,), (numel // 4, 3)]
    plain = NoiseSource(0)
    correlated = CorrelatedNoiseSource(NoiseSource(0), optimize_banded_toeplitz(10_000, bands))
    times: dict[str, list[float]] = {"NoiseSource": [], f"CorrelatedNoiseSource b={bands}": []}
    for step in range(repeats):
        for name, source in zip(times, (plain, correlated), strict=True):
            start = time.perf_counter()
            source.normal(step=step, shapes=shapes, std=1.0, device="cpu", dtype=torch.float32)
            times[name].append(time.perf_counter() - start)
    print(f"\nnoise per step, {numel} float32 values, median of {repeats} interleaved (first {bands} skipped):")
    for name, values in times.items():
        print(f"  {name}: {1e3 * statistics.median(values[bands:]):.2f} ms")
    print(f"  kept rows: {correlated.memory_bytes / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"{platform.node()} {platform.processor()} torch {torch.__version__} threads {torch.get_num_threads()}\n")
    strategies(args.quick)
    noise_needed("rdp")
    noise_time(1_000_000 if args.quick else 10_000_000, 8, 20 if args.quick else 40)


if __name__ == "__main__":
    main()
