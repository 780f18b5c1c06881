"""``hf-dp-epsilon`` / ``python -m hf_dp.accounting``: epsilon, or the calibrated noise multiplier, per accountant.

Proven upper bounds come first ("prv", then "rdp"); "gdp" comes last, on a line labelled as an estimate. GDP never
calibrates: with ``--target-epsilon`` its line gives its epsilon estimate at the noise multiplier calibrated by the
first proven accountant listed.
"""

from __future__ import annotations

import argparse
import sys

from .functional import epsilon, noise_multiplier
from .methods import ACCOUNTANTS, PROVEN_ACCOUNTANTS

BOUND = "upper bound"
ESTIMATE = "estimate, not a bound"

EPILOG = f"""\
Output: one line per accountant, tab-separated: name, value, label. The proven upper bounds come first
({", ".join(PROVEN_ACCOUNTANTS)}), labelled '{BOUND}'; 'gdp' (central limit theorem) comes last, labelled
'{ESTIMATE}': it can be below the true epsilon. With --target-epsilon, each proven accountant prints its calibrated
noise multiplier; 'gdp' never calibrates and prints instead its epsilon estimate at the noise multiplier of the first
proven accountant listed (so --accountants gdp alone is refused with --target-epsilon).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dp-epsilon",
        description="Privacy of DP-SGD with Poisson sampling: epsilon for a noise multiplier, or the noise "
        "multiplier for a target epsilon, under every accountant.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--noise-multiplier", type=float, help="sigma (noise std / clipping norm)")
    target.add_argument("--target-epsilon", type=float, help="calibrate sigma to this epsilon (proven accountants)")
    parser.add_argument("--sample-rate", type=float, required=True, help="q = expected batch size / dataset size")
    parser.add_argument("--steps", type=int, required=True, help="number of noisy steps")
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument(
        "--accountants",
        nargs="+",
        default=_ordered(ACCOUNTANTS),
        choices=_ordered(ACCOUNTANTS),
        help="which to report (default: all; printed proven bounds first)",
    )
    return parser


def _ordered(names) -> list[str]:
    """Proven accountants first, in ``PROVEN_ACCOUNTANTS`` order, then the estimates."""
    names = list(dict.fromkeys(names))
    return [n for n in PROVEN_ACCOUNTANTS if n in names] + sorted(n for n in names if n not in PROVEN_ACCOUNTANTS)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = _ordered(args.accountants)
    proven = [n for n in names if n in PROVEN_ACCOUNTANTS]
    lines = []
    try:
        if args.noise_multiplier is not None:
            for name in names:
                value = epsilon(args.noise_multiplier, args.sample_rate, args.steps, args.delta, accountant=name)
                lines.append(f"{name}\tepsilon={value:.4f}\t{BOUND if name in proven else ESTIMATE}")
        else:
            if not proven:
                raise ValueError(
                    f"{names} cannot calibrate the noise: GDP is an estimate, not a bound. Add one of "
                    f"{list(PROVEN_ACCOUNTANTS)} to `--accountants`."
                )
            sigmas = {
                name: noise_multiplier(args.target_epsilon, args.delta, args.sample_rate, args.steps, accountant=name)
                for name in proven
            }
            for name in names:
                if name in sigmas:
                    lines.append(f"{name}\tnoise_multiplier={sigmas[name]:.4f}\t{BOUND}")
                else:
                    sigma = sigmas[proven[0]]
                    value = epsilon(sigma, args.sample_rate, args.steps, args.delta, accountant=name)
                    lines.append(
                        f"{name}\tepsilon={value:.4f} at noise_multiplier={sigma:.4f} ({proven[0]})\t{ESTIMATE}"
                    )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
