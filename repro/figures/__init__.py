"""Paper figures and the report, generated only from finished jobs under runs/."""

from repro.figures.jobs import load_runs
from repro.figures.report import write_report

__all__ = ["load_runs", "write_report"]
