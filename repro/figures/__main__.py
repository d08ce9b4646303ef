"""`python -m repro.figures --runs runs --out figures [--html]`: render figures and figures/REPORT.md
(and, with --html, figures/REPORT.html: the same report as one self-contained file with the images inlined)."""

import sys

from repro import cli
from repro.errors import ReproError
from repro.figures.jobs import check_out_dir
from repro.figures.report import write_report
from repro.tracking import log_report_figures


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.figures", description=__doc__)
    parser.add_argument("--runs", default="runs")
    parser.add_argument("--out", default="figures")
    parser.add_argument("--html", action="store_true", help="also write REPORT.html beside REPORT.md")
    args = parser.parse_args(argv)
    try:
        check_out_dir(args.out)
        report = write_report(args.runs, args.out)
        print(report)
        log_report_figures(args.out, args.runs)  # the report's PNGs to a W&B run of job_type "report"
        if args.html:
            from repro.figures.html import write_html

            print(write_html(report, report.with_suffix(".html")))
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
