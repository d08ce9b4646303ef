"""`python -m repro.figures --runs runs --out figures`: render figures and figures/REPORT.md."""

import argparse
import sys

from repro.errors import ReproError
from repro.figures.report import write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default="runs")
    parser.add_argument("--out", default="figures")
    args = parser.parse_args(argv)
    try:
        print(write_report(args.runs, args.out))
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
