"""The import graph of repro/ and bench/ (files as nodes): no circle, and imports run from a higher layer to a
lower one, except the few listed in ALLOWED_UPWARD, each marked `# layer:` with its reason on the import line.

Layers, lowest first (a file belongs to the longest prefix that names it): the data flow of DESIGN.md, with the
cost model (the simulator's pricing files, which the evaluator reports per job) between exact counting and the
evaluator, and the config schema (which only composes each group's own check) below the entry points that call it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ("repro.errors", "repro.atomic", "repro.config_values", "repro.parallel", "repro.jobdir", "repro.tracking",
     "repro.tune_config", "repro.cli", "repro.exec_config", "repro.proctree"),  # exec_config: the exec group's check, torch-free
    ("repro.traces",),
    ("repro.workloads",),
    ("repro.routing",),
    ("repro.affinity",),
    ("repro.systems",),
    ("repro.kernels",),
    ("repro.counting",),  # exact counting under both the evaluator and the cost model
    ("repro.sim.hardware", "repro.sim.shapes", "repro.sim.traffic", "repro.sim.costs"),  # the one cost model
    ("repro.eval",),
    ("repro.sim",),
    ("repro.drift",),  # placement over time: systems re-fitted window by window, scored by the evaluator
    ("repro.exec",),
    ("repro.engines",),
    ("repro.config_schema",),
    ("repro.run",),
    ("repro.tune",),
    ("repro.figures",),
    ("repro.side_by_side",),
    ("bench",),
]
ALLOWED_UPWARD = {("repro.routing.fit_synthetic", "repro.affinity.stats")}  # at most two, each commented


def module_files() -> dict[str, Path]:
    files = {}
    for root in ("repro", "bench"):
        for f in (ROOT / root).rglob("*.py"):
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            files[mod.removesuffix(".__init__")] = f
    return files


def import_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """{module: {imported project module: line}} (imports inside functions count; package __init__s do not)."""

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        edges = {}
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target and target != mod and files[target].name != "__init__.py":
                    edges.setdefault(target, node.lineno)
        graph[mod] = edges
    return graph


def layer_of(mod: str) -> int | None:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (mod == prefix or mod.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def circles(graph) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)  # noqa: E702
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)  # noqa: E702
                    work.append((w, iter(graph.get(w, ()))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)  # noqa: E702
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle():
    assert circles(import_graph(module_files())) == []


def test_imports_run_downward_but_the_commented_few():
    files = module_files()
    upward = {}
    for mod, edges in import_graph(files).items():
        for target, line in edges.items():
            low, high = layer_of(mod), layer_of(target)
            if low is not None and high is not None and high > low:
                upward[(mod, target)] = line
    assert set(upward) <= ALLOWED_UPWARD, f"imports from a lower layer up: {sorted(set(upward) - ALLOWED_UPWARD)}"
    # positive control, and no stale allowance: each allowed arrow is found (an empty graph would pass the above)
    assert set(upward) == ALLOWED_UPWARD, f"allowed but no longer imported: {sorted(ALLOWED_UPWARD - set(upward))}"
    assert len(ALLOWED_UPWARD) <= 2
    for (mod, _), line in upward.items():
        text = files[mod].read_text(encoding="utf-8").splitlines()[line - 1]
        assert "# layer:" in text, f"{mod}:{line} imports upward without a `# layer:` comment saying why"


def test_every_project_file_has_a_layer():
    unplaced = [m for m in module_files() if layer_of(m) is None and m not in ("repro", "repro.__main__")]
    assert unplaced == []
