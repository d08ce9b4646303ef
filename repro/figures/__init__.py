"""Paper figures and the report, generated only from finished jobs under runs/."""

from repro.figures.report import load_runs, write_report

__all__ = ["load_runs", "write_report"]
