"""One colour and one line style per system across every figure of the report, the paper section and the
replication section, so a system is recognised at a glance from figure to figure.

    style = series_style("token_oracle", "bound")   # {"color": ..., "linestyle": "--", "label": "token_oracle (bound)"}

Deployable systems are drawn solid; bounds (proven ceilings) dashed and hindsight fits (fitted on the evaluated
routing: no deployable system, no ceiling) dash-dotted, each labelled with its kind.
"""

from __future__ import annotations

import zlib

from matplotlib.colors import to_rgb

# seaborn's "deep" colours; the paper's four systems keep the colours the paper figures used before the palette
SYSTEM_COLORS = {
    "ep": "#4c72b0",
    "eplb": "#8c8c8c",
    "moetuner": "#dd8452",
    "semmoe": "#c44e52",
    "semmoe_paper": "#e377c2",  # Algorithm 2 (the paper's DP scheduler); in the paper figures it is named semmoe
    "semmoe_load": "#937860",  # the load-aware default, when the paper figures name Algorithm 2 semmoe
    "semmoe_exact": "#7f7f7f",
    "semmoe_replicated": "#8172b3",
    "semmoe_hottest": "#da8bc3",
    "semmoe_hierarchical": "#55a868",
    "fit_assign": "#ccb974",
    "token_oracle": "#1f1f1f",
    "dp_bound": "#1f1f1f",
}
# for systems added later: a stable colour from the name (same in every figure and every run of the report)
FALLBACK_COLORS = ("#64b5cd", "#a55194", "#6b6ecf", "#8ca252", "#bd9e39", "#ad494a", "#3182bd", "#e6550d")
# the parts of one MoE layer (paper Fig. 1); the all-to-all parts in one hue family, none a system's colour
MOE_PART_COLORS = {"gate": "#c7c7c7", "dispatch": "#6baed6", "experts": "#d9d9a0", "combine": "#2171b5"}
KIND_LINESTYLE = {"system": "-", "bound": "--", "hindsight": "-."}
VARIANT_MARKERS = ("o", "s", "^", "D", "v", "P")


def system_color(system: str) -> str:
    """The colour of `system` in every figure."""
    if system in SYSTEM_COLORS:
        return SYSTEM_COLORS[system]
    return FALLBACK_COLORS[zlib.crc32(str(system).encode()) % len(FALLBACK_COLORS)]


def kind_label(system: str, kind: str | None) -> str:
    """`system`, with its kind in brackets when it is not a deployable system ("token_oracle (bound)")."""
    return system if not isinstance(kind, str) or kind == "system" else f"{system} ({kind})"


def series_style(system: str, kind: str | None = "system", variant: int = 0) -> dict:
    """matplotlib keyword arguments (color, linestyle, marker, label) for a line series of `system`. `variant` > 0
    tells apart several series of one system (e.g. lookback 0 and 2): the same colour, lighter, and another marker."""
    kind = kind if isinstance(kind, str) else "system"
    color = system_color(system)
    if variant:
        lighten = min(0.3 * variant, 0.7)  # mix with white: still the system's hue, visibly another series
        color = tuple((1 - lighten) * c + lighten for c in to_rgb(color))
    return {"color": color, "linestyle": KIND_LINESTYLE.get(kind, "-"), "marker": VARIANT_MARKERS[variant % len(VARIANT_MARKERS)],
            "label": kind_label(system, kind)}
