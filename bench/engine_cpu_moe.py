"""vLLM's own CPU fused-MoE kernel at the served model's shape, as an expert table; run with the engine venv's python
by bench.engine_cpu (it imports vllm, never repro):

    OMP_NUM_THREADS=1 VLLM_TARGET_DEVICE=cpu .venv-engine-cpu/bin/python bench/engine_cpu_moe.py \
        HIDDEN INTERMEDIATE EXPERTS TOP_K REPEATS ROWS [ROWS ...]

A microbenchmark, not a serving measurement: the kernel the engine's MoE layers call on this CPU (`cpu_fused_moe`
with weights prepacked by `cpu_prepack_moe_weight`, the "vec" ISA that `CPUUnquantizedExperts` uses without AMX),
fp32, one thread (the engine's worker runs on one core), back to back as an engine's layers run. Per n in ROWS:
n x EXPERTS / TOP_K tokens whose TOP_K experts are distinct and spread so that every expert gets n rows; the median
call time / EXPERTS is the per-slot seconds the simulator sums over a device's slots. Prints one JSON line:
[[n, seconds per slot], ...].
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import torch
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    hidden, inter, experts, top_k, repeats, *rows_list = (int(a) for a in argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w13 = cpu_prepack_moe_weight(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5, "vec")
    w2 = cpu_prepack_moe_weight(torch.randn(experts, hidden, inter, generator=g) / inter**0.5, "vec")
    table = []
    for n in rows_list:
        tokens = max(1, n * experts // top_k)
        x = torch.randn(tokens, hidden, generator=g)
        ids = ((torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)[None, :]) % experts).to(torch.int32)
        weights = torch.full((tokens, top_k), 1.0 / top_k)
        out = torch.empty_like(x)
        times = []
        for i in range(2 + repeats):
            start = time.perf_counter()
            cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, MoEActivation.SILU.value, "vec")
            if i >= 2:  # two warm-up calls
                times.append(time.perf_counter() - start)
        times.sort()
        table.append([n, times[len(times) // 2] / experts])
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
