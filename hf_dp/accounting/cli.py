"""``hf-dp-epsilon`` / ``python -m hf_dp.accounting``: epsilon, or the calibrated noise multiplier, per accountant."""

from __future__ import annotations

import argparse
import sys

from .functional import epsilon, noise_multiplier
from .methods import ACCOUNTANTS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dp-epsilon",
        description="Privacy of DP-SGD with Poisson sampling: epsilon for a noise multiplier, or the noise "
        "multiplier for a target epsilon, under every accountant.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--noise-multiplier", type=float, help="sigma (noise std / clipping norm)")
    target.add_argument("--target-epsilon", type=float, help="calibrate sigma to this epsilon")
    parser.add_argument("--sample-rate", type=float, required=True, help="q = expected batch size / dataset size")
    parser.add_argument("--steps", type=int, required=True, help="number of noisy steps")
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument(
        "--accountants", nargs="+", default=sorted(ACCOUNTANTS), choices=sorted(ACCOUNTANTS), help="which to report"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for name in args.accountants:
            if args.noise_multiplier is not None:
                value = epsilon(args.noise_multiplier, args.sample_rate, args.steps, args.delta, accountant=name)
                print(f"{name}\tepsilon={value:.4f}")
            else:
                value = noise_multiplier(args.target_epsilon, args.delta, args.sample_rate, args.steps, accountant=name)
                print(f"{name}\tnoise_multiplier={value:.4f}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
