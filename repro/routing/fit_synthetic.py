"""Fit the synthetic router's knobs to measured routing statistics (the procedure behind conf/model/synthetic_*.yaml).

    python -m repro.routing.fit_synthetic --model olmoe-1b-7b --tokenizer olmoe     # 64 experts, top-8
    python -m repro.routing.fit_synthetic --model mixtral-8x7b --tokenizer mixtral  # 8 experts, top-2

Targets, from the olmoe-routing tables of ../shared/data (measured on real text at model layers 0, 7, 15):
  - Table 1 medians (static top-k F1 p50, cumulative top-k hotness p50, max non-top-k hotness p50) of a trace
    *replayed* from the tables on MMLU prompts (`affinity_statistics`; replay reproduces each token's measured
    per-layer expert distribution exactly, so these are the real model's statistics on this workload);
  - expert load skew: the coefficient of variation of `expert_count` over experts, mean over the 3 layers;
  - layer-to-layer dependence: mutual information (nats) of the slot-zipped pair counts `cross_count`
    (layers 0->7 and 7->15), mean of the two.
The synthetic router is run with the model's E and k on 16 MoE layers of the same prompts and measured at
layers 0, 7 and 15 the same way (pairs zipped by slot); a grid over concentration, popularity_skew and
persistence is scored by the sum of squared relative errors, and the best rows are printed. Other knobs keep
their defaults. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import itertools

import numpy as np

from repro import cli
from repro.affinity.stats import affinity_statistics  # layer: a CLI fitting Table-1 stats; nothing imports it
from repro.routing.replay import load_replay_tables, resolve_table_paths, route_with_replay
from repro.routing.synthetic import route_with_synthetic
from repro.traces import RoutingTrace

STATS = ("f1_p50", "topk_hotness_p50", "max_nontopk_hotness_p50")
RECORDED = (0, 7, 15)


def pair_mutual_information(pairs_EE: np.ndarray) -> float:
    """Mutual information (nats) of a pair-count matrix float[E, E]."""
    p = pairs_EE / pairs_EE.sum()
    outer = p.sum(axis=1, keepdims=True) * p.sum(axis=0, keepdims=True)
    nz = p > 0
    return float((p[nz] * np.log(p[nz] / outer[nz])).sum())


def zipped_pairs(trace: RoutingTrace, layer_a: int, layer_b: int) -> np.ndarray:
    """float64[E, E] (expert at layer_a, expert at layer_b) counts, slot j paired with slot j (as cross_count)."""
    num_experts = trace.meta.num_experts
    a = trace.experts[:, layer_a].astype(np.int64).ravel()
    b = trace.experts[:, layer_b].astype(np.int64).ravel()
    return np.bincount(a * num_experts + b, minlength=num_experts**2).reshape(num_experts, num_experts).astype(float)


def trace_statistics(trace: RoutingTrace, layers=(0, 1, 2)) -> dict:
    """Table 1 medians (mean over `layers`), load CV and zipped-pair MI between consecutive `layers`."""
    stats = affinity_statistics(trace, layers=list(layers))
    out = {name: float(stats[name].mean()) for name in STATS}
    num_experts = trace.meta.num_experts
    loads = [np.bincount(trace.experts[:, la].astype(np.int64).ravel(), minlength=num_experts) for la in layers]
    out["load_cv"] = float(np.mean([lo.std() / lo.mean() for lo in loads]))
    out["pair_mi"] = float(np.mean([pair_mutual_information(zipped_pairs(trace, a, b)) for a, b in zip(layers, layers[1:], strict=False)]))
    return out


def measured_targets(model: str, workload, data_root: str = "../shared/data") -> dict:
    """The targets above for one olmoe-routing model on the workload's prompts."""
    files = resolve_table_paths(f"{data_root}/olmoe-routing/{model}/*.npz")
    replayed = route_with_replay(
        {"name": model, "tables": [str(f) for f in files]}, workload.requests, [],
        cache_dir=None, seed=0, dataset=workload.name, tokenizer="", vocab_size=workload.vocab_size,
    )
    targets = trace_statistics(replayed)
    tables = load_replay_tables(files)
    del tables  # loaded only to fail early on a broken file; counts below come from the raw arrays
    counts = [np.load(f) for f in files]
    load_LE = np.sum([c["expert_count"] for c in counts], axis=0).astype(float)
    cross = np.sum([c["cross_count"] for c in counts], axis=0).astype(float)
    targets["load_cv"] = float(np.mean(load_LE.std(axis=1) / load_LE.mean(axis=1)))
    targets["pair_mi"] = float(np.mean([pair_mutual_information(c) for c in cross]))
    return targets


def score(stats: dict, targets: dict) -> float:
    return float(sum(((stats[k] - targets[k]) / max(abs(targets[k]), 0.05)) ** 2 for k in targets))


def main(argv=None) -> None:
    from repro.workloads import load_workload

    parser = cli.ArgumentParser(prog="python -m repro.routing.fit_synthetic", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmoe-1b-7b")
    parser.add_argument("--tokenizer", default="olmoe")
    parser.add_argument("--requests", type=cli.positive, default=1000)
    parser.add_argument("--concentration", default="0.8,0.9,0.95")
    parser.add_argument("--skew", default="0.3,0.6,0.9")
    parser.add_argument("--persistence", default="0.3,0.6,0.9")
    args = parser.parse_args(argv)
    workload = load_workload("mmlu", tokenizer=args.tokenizer, num_requests=args.requests, balanced=True, max_prompt_len=512)
    tables = load_replay_tables(resolve_table_paths(f"../shared/data/olmoe-routing/{args.model}/*.npz"))
    targets = measured_targets(args.model, workload)
    print("targets", {k: round(v, 4) for k, v in targets.items()})
    rows = []
    grid = itertools.product(*(map(float, s.split(",")) for s in (args.concentration, args.skew, args.persistence)))
    for concentration, skew, persistence in grid:
        cfg = {
            "num_experts": tables.num_experts, "top_k": tables.top_k, "num_layers": 16, "first_layer": 0,
            "groups": max(1, tables.num_experts // (2 * tables.top_k)), "candidates": 2 * tables.top_k,
            "concentration": concentration, "popularity_skew": skew, "persistence": persistence,
        }
        trace = route_with_synthetic(cfg, workload.requests, [], cache_dir=None, seed=0, dataset=workload.name,
                                     tokenizer=args.tokenizer, vocab_size=workload.vocab_size)
        stats = trace_statistics(trace, RECORDED)
        rows.append((score(stats, targets), concentration, skew, persistence, stats))
        print(f"c={concentration} skew={skew} p={persistence} score={rows[-1][0]:.3f}",
              {k: round(v, 4) for k, v in stats.items()}, flush=True)
    rows.sort(key=lambda r: r[0])
    print("best:", *(f"c={r[1]} skew={r[2]} p={r[3]} score={r[0]:.3f}" for r in rows[:3]), sep="\n  ")


if __name__ == "__main__":
    main()
