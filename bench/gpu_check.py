"""One-GPU correctness and calibration check of every repro.kernels kernel; never needed by tests or CI.

    python -m bench.gpu_check --out DIR [--tokens 1024 4096 16384] [--dtypes bf16 fp16]

For each T and dtype, every contract kernel (the cases of bench.bench_kernels: Mixtral-shaped layer,
DeepSeek-V3 routing, Sem-MoE shuffle) runs through Triton and through its torch reference on the same inputs;
the outputs are compared (integer outputs exactly, float outputs within TOLERANCES of their dtype) and both
are timed with triton.testing.do_bench (median, CUDA events). Two timing rows per T put the Sem-MoE shuffle
in context: `semmoe_shuffle_vs_argsort` (torch_ms: a stable torch.argsort of the same predicted device ids,
the paper's "argsort(dev_ids)") and `semmoe_shuffle_vs_moe_layer` (torch_ms: one Mixtral-shaped MoE layer
through the Triton kernels: gating, permute, fused_experts, unpermute). About 2 minutes on an H200.

Writes DIR/gpu_check.json ({"meta": ..., "rows": [...]}) and DIR/gpu_check.csv (the rows), both atomically.
A row: kernel, shape, dtype, tokens, triton_ms, torch_ms, speedup (= torch_ms / triton_ms), max_abs_error
(float outputs), int_mismatches (integer outputs), tolerance, passed (null for timing-only rows), note.
A simulator reads triton_ms per (kernel, dtype, tokens) as calibration.
Exit status: 0 every check passed, 1 a check failed or raised, 2 no usable CUDA device or a bad command line.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.bench_kernels import (
    HIDDEN,
    INTERMEDIATE,
    MIXTRAL,
    SHUFFLE,
    collect_cases,
    median_ms,
    moe_inputs,
    shuffle_context,
)
from repro.atomic import atomic_write_text
from repro.kernels import interpreter_on

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = (1024, 4096, 16384)
# |triton - torch| <= atol + rtol * |torch| per output dtype; bf16 / fp16 allow a few units in the last place
# of an O(1) value, since fp32 accumulation order differs between a tiled kernel and torch's matmul
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 4e-3, "atol": 4e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
}
COLUMNS = ("kernel", "shape", "dtype", "tokens", "triton_ms", "torch_ms", "speedup", "max_abs_error",
           "int_mismatches", "tolerance", "passed", "note")
NO_CUDA = ("bench.gpu_check needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False); "
           "run it on a machine with one GPU, e.g. `make gpu-check` there.")
INTERPRETER_ON = ("bench.gpu_check times compiled Triton kernels but TRITON_INTERPRET is set; "
                  "unset it (env -u TRITON_INTERPRET) and run again.")


def tensors(output) -> list[torch.Tensor]:
    """The tensors of a kernel output (a tensor, or a tuple / NamedTuple of them), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    return [t for part in output for t in tensors(part)]


def compare(got, want) -> dict:
    """max_abs_error over float outputs, int_mismatches over integer outputs, tolerance, passed."""
    max_error, mismatches, passed, tolerance = 0.0, 0, True, "exact"
    got_list, want_list = tensors(got), tensors(want)
    if len(got_list) != len(want_list):
        return {"max_abs_error": None, "int_mismatches": None, "tolerance": "exact", "passed": False}
    for a, b in zip(got_list, want_list, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            passed = False
            continue
        if a.is_floating_point():
            tol = TOLERANCES[a.dtype]
            tolerance = f"rtol {tol['rtol']:g} atol {tol['atol']:g} ({str(a.dtype).removeprefix('torch.')})"
            if a.numel():
                diff = (a.double() - b.double()).abs()
                max_error = max(max_error, float(diff.max()))
                passed &= bool((diff <= tol["atol"] + tol["rtol"] * b.double().abs()).all())
        else:
            wrong = int((a != b).sum())
            mismatches += wrong
            passed &= wrong == 0
    return {"max_abs_error": max_error, "int_mismatches": mismatches, "tolerance": tolerance, "passed": passed}


def row(kernel: str, shape: str, dtype: str, tokens: int, triton_ms: float | None, torch_ms: float | None,
        check: dict | None = None, note: str = "") -> dict:
    check = check or {"max_abs_error": None, "int_mismatches": None, "tolerance": None, "passed": None}
    speedup = torch_ms / triton_ms if triton_ms and torch_ms else None
    return {"kernel": kernel, "shape": shape, "dtype": dtype, "tokens": tokens, "triton_ms": triton_ms,
            "torch_ms": torch_ms, "speedup": speedup, **check, "note": note}


def check_case(case, dtype_name: str) -> dict:
    """Run one bench_kernels case through both paths, compare, time; a raising kernel is a failed row."""
    try:
        result = compare(case.run_triton(), case.run_torch())
        triton_ms = median_ms(case.run_triton, True, 0, 0)
        torch_ms = median_ms(case.run_torch, True, 0, 0)
        return row(case.kernel, case.shape, dtype_name, case.tokens, triton_ms, torch_ms, result)
    except Exception as e:  # keep going: one broken kernel must not hide the others' numbers
        failed = {"max_abs_error": None, "int_mismatches": None, "tolerance": None, "passed": False}
        return row(case.kernel, case.shape, dtype_name, case.tokens, None, None, failed,
                   note=f"{type(e).__name__}: {e}".splitlines()[0])


def shuffle_context_rows(num_tokens: int) -> list[dict]:
    """semmoe_shuffle vs a torch.argsort shuffle of the same device ids, and vs one MoE layer (Triton)."""
    from repro.kernels.dispatch import permute, unpermute
    from repro.kernels.gating import topk_softmax
    from repro.kernels.grouped_gemm import fused_experts
    from repro.kernels.shuffle import semmoe_shuffle

    step = shuffle_context(num_tokens, "cuda", seed=0)
    args = (step["plan"], step["token_ids_T"], step["layer"], step["prev_experts_Thk"])
    shuffle_ms = median_ms(lambda: semmoe_shuffle(*args, backend="triton"), True, 0, 0)
    device_ids, _ = step["plan"].predicted_devices(
        step["token_ids_T"].cpu().numpy(), step["layer"], step["prev_experts_Thk"].cpu().numpy()
    )
    device_ids_T = torch.as_tensor(device_ids, device="cuda")
    argsort_ms = median_ms(lambda: torch.argsort(device_ids_T, stable=True), True, 0, 0)

    layer = moe_inputs(num_tokens, torch.bfloat16, "cuda", seed=0)
    router_TE = torch.randn(num_tokens, MIXTRAL["experts"], device="cuda", dtype=torch.bfloat16)

    def moe_layer():
        weights_Tk, ids_Tk = topk_softmax(router_TE, MIXTRAL["top_k"], True, backend="triton")
        x_MH, offsets_E1, slot_position_Tk = permute(layer["x_TH"], ids_Tk, MIXTRAL["experts"], backend="triton")
        y_MH = fused_experts(x_MH, offsets_E1, layer["w13_E2IH"], layer["w2_EHI"], backend="triton")
        return unpermute(y_MH, slot_position_Tk, weights_Tk, backend="triton")

    layer_ms = median_ms(moe_layer, True, 0, 0)
    shape = f"T{num_tokens} E{SHUFFLE['experts']} k{SHUFFLE['top_k']} D{SHUFFLE['ranks']} h2"
    return [
        row("semmoe_shuffle_vs_argsort", shape, "int64", num_tokens, shuffle_ms, argsort_ms,
            note="torch_ms: torch.argsort(stable) of the same predicted device ids (sorting only, no prediction)"),
        row("semmoe_shuffle_vs_moe_layer", shape, "bf16", num_tokens, shuffle_ms, layer_ms,
            note=f"torch_ms: one Triton MoE layer (H{HIDDEN} I{INTERMEDIATE} E{MIXTRAL['experts']} "
                 f"k{MIXTRAL['top_k']}: gating, permute, fused_experts, unpermute); speedup = layer / shuffle"),
    ]


def to_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS} for r in rows)
    return buffer.getvalue()


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    """DIR/gpu_check.json and DIR/gpu_check.csv, each written atomically."""
    atomic_write_text(out / "gpu_check.json", json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    atomic_write_text(out / "gpu_check.csv", to_csv(rows))


def usable_gpu() -> str | None:
    """None when compiled Triton kernels can run on a CUDA device here, else the sentence saying why not."""
    if not torch.cuda.is_available():
        return NO_CUDA
    if interpreter_on():
        return INTERPRETER_ON
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json and gpu_check.csv")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per step T")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="data dtypes")
    args = parser.parse_args(argv)
    if min(args.tokens) < SHUFFLE["ranks"]:
        parser.error(f"--tokens must be >= {SHUFFLE['ranks']} (a token per TP rank of the shuffle plan)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = usable_gpu()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import triton

    started = time.perf_counter()
    meta = {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "timing": "triton.testing.do_bench, median ms of one call (CUDA events, L2 flushed between calls)",
        "speedup": "torch_ms / triton_ms (> 1: Triton faster)",
        "tolerances": {str(k).removeprefix("torch."): v for k, v in TOLERANCES.items()} | {"integer": "exact"},
        "tokens": args.tokens, "dtypes": args.dtypes,
    }
    rows: list[dict] = []
    for num_tokens in args.tokens:
        for name in args.dtypes:
            cases, skipped = collect_cases(num_tokens, DTYPES[name], "cuda")
            for module, reason in skipped.items():
                rows.append(row(module, "", name, num_tokens, None, None,
                                {"max_abs_error": None, "int_mismatches": None, "tolerance": None, "passed": False},
                                note=reason))
            for case in cases:
                rows.append(check_case(case, name))
                r = rows[-1]
                print(f"T={num_tokens:>6} {name} {r['kernel']:<22} triton {r['triton_ms'] or float('nan'):8.3f} ms  "
                      f"torch {r['torch_ms'] or float('nan'):8.3f} ms  {'ok' if r['passed'] else 'FAIL ' + r['note']}",
                      flush=True)
        try:
            rows += shuffle_context_rows(num_tokens)
        except Exception as e:  # the context rows are timing only; record why they are missing
            traceback.print_exc()
            rows.append(row("semmoe_shuffle_context", "", "", num_tokens, None, None, note=f"{type(e).__name__}: {e}"))
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_results(args.out, meta, rows)
    failed = [r for r in rows if r["passed"] is False]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows ok, {len(failed)} failed, {meta['elapsed_s']} s -> "
          f"{args.out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
