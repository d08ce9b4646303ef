"""What every figure module shares: the atomic PNG writer and the markdown table format.

A leaf module (it imports no other repro.figures module), so report.py, paper.py, replication.py and diff.py can
all build on it without importing one another in a circle.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from repro.atomic import atomic_write  # noqa: E402


def save_png(fig, path: Path) -> Path:
    """Write `fig` as a PNG at `path` atomically (a kill never leaves a truncated figure linked from the report)
    and close it, also on failure. The format is explicit: the temporary name's suffix is not .png."""
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return Path(path)


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table; floats with 4 decimals."""
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)
