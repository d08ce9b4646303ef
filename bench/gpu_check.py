"""One-GPU correctness and calibration check of every repro.kernels kernel; never needed by tests or CI.

    python -m bench.gpu_check --out DIR [--tokens 1024 4096 16384] [--dtypes bf16 fp16] [--measured-dir D]
                              [--name NAME] [--skip-correctness] [--dry-run]
    python -m bench.gpu_check --tune --out DIR

For each T and dtype, every contract kernel (the cases of bench.kernel_cases: Mixtral-shaped layer,
DeepSeek-V3 routing, Sem-MoE shuffle) runs through Triton and through its torch reference on the same inputs;
the outputs are compared (integer outputs exactly, float outputs within TOLERANCES of their dtype) and both
are timed with triton.testing.do_bench (median, CUDA events). Two timing rows per T put the Sem-MoE shuffle
in context: `semmoe_shuffle_vs_argsort` (torch_ms: a stable torch.argsort of the same predicted device ids,
the paper's "argsort(dev_ids)") and `semmoe_shuffle_vs_moe_layer` (torch_ms: one Mixtral-shaped MoE layer
through the Triton kernels: gating, permute, fused_experts, unpermute). About 2 minutes on an H200.

Writes DIR/gpu_check.json ({"meta": ..., "rows": [...]}) and DIR/gpu_check.csv (the rows), both atomically.
A row: kernel, shape, dtype, tokens, triton_ms, torch_ms, speedup (= torch_ms / triton_ms), max_abs_error
(float outputs), int_mismatches (integer outputs), tolerance, passed (null for timing-only rows), note.

Fair baselines (`expert_rows`, DeepSeek-V2-Lite / Qwen3-30B-A3B / Mixtral-8x7B expert shapes at 16 / 256 /
4,096 / 16,384 tokens, bf16): the Triton grouped GEMM against a bf16 cuBLAS per-expert loop (torch matmuls on
the same sorted rows), the whole Triton layer (fused_moe, gathered rows, validate=False) against vLLM's
fused_experts when vllm is importable (the row says so when not), each with TFLOP/s and the fraction of a dense
cuBLAS GEMM pair of the same FLOPs (dense_ms / kernel_ms). Calibration (`measured_expert_gemm`): one Triton
grouped-GEMM call over a rank's E / 8 experts at 1..16,384 rows each, divided by its experts (the simulator sums
the table over a rank's slots, and the kernel launches once per rank), written as DIR/measured.json in the form of a
hardware profile's `measured:` section ({"expert_gemm": {shape: [[tokens of one expert, seconds], ...]}}, what
repro.sim.hardware reads), and as the calibration file the simulator merges: D/<name>.yaml (default
conf/hardware/measured/<name>.yaml, name from the GPU model, e.g. h200; a copy in DIR/measured/) holding the
expert GEMM tables, the kernel floor (median time of the smallest kernel call with work: one row through the
Triton grouped GEMM) and, with two or more local GPUs, the NCCL all-to-all (torch.distributed
all_to_all_single on all N GPUs, 4 KiB to 16 MiB per peer: [busiest rank's remote bytes, seconds], the
slowest rank's median) for dispatch and combine; its `notes` give the fixed cost, the bandwidth, the
achieved TFLOP/s and the host launch time (read by people, not by the simulator). DeepEP is not driven
here (the notes say whether it is installed); deepep_* stay on their formulas. A file at D/<name>.yaml
that this script did not write is never overwritten.
--dry-run rehearses everything on the CPU (torch references, shapes / 64, 16 tokens, fp32, all-to-all on gloo with
2 processes): the files say dry_run, are written under DIR only, and their numbers are not calibration.
--tune times every CANDIDATE_TILES config of repro.kernels.grouped_gemm for each expert shape (bf16) and
rows-per-expert bucket of its DEFAULT_TILES, keeps the fastest, and merges the result into
repro/kernels/configs/<device>.json (vLLM's per-device JSON in spirit; entries for other shapes are kept), which
the grouped GEMM then uses on that device (about a minute on an H200); then it exits.
Exit status: 0 every check passed, 1 a check failed or raised, 2 no usable CUDA device or a bad command line.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import io
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml

from bench.a2a_probe import A2A_PEER_BYTES, A2A_REPEATS, a2a_summary, measure_a2a
from bench.kernel_cases import (
    HIDDEN,
    INTERMEDIATE,
    MIXTRAL,
    SHUFFLE,
    collect_cases,
    median_ms,
    moe_inputs,
    shuffle_context,
)
from repro import cli
from repro.atomic import atomic_write_text
from repro.errors import ConfigError
from repro.kernels import interpreter_on
from repro.sim.hardware import MEASURED_DIR

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
    """Run one bench.kernel_cases case through both paths, compare, time; a raising kernel is a failed row."""
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


# (hidden, expert intermediate, experts, top-k) from conf/sim/shape/<name>.yaml
EXPERT_SHAPES = {
    "deepseek_v2_lite": (2048, 1408, 64, 6),
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "mixtral_8x7b": (4096, 14336, 8, 2),
}
BASELINE_TOKENS = (16, 256, 4096, 16384)
CALIBRATION_ROWS = (1, 16, 64, 256, 1024, 4096, 16384)


def vllm_fused_experts():
    """(vLLM's fused_experts, None) or (None, why it is not importable)."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts

        return fused_experts, None
    except Exception as e:  # not installed, or installed for another torch / CUDA
        return None, f"vllm fused_experts not importable ({type(e).__name__}: {e})".splitlines()[0]


def baseline_ms(x_TH, ids_Tk, weights_Tk, w13_E2IH, w2_EHI, cuda: bool, vllm_fn) -> tuple[dict, int]:
    """({grouped_gemm, cublas_loop, dense, layer[, vllm]}: median ms, routed rows M) of one shape and step."""
    import torch.nn.functional as F

    from repro.kernels.dispatch import permute_reference
    from repro.kernels.grouped_gemm import fused_experts
    from repro.kernels.moe_layer import fused_moe

    backend = "triton" if cuda else "torch"
    experts, inter = w2_EHI.shape[0], w2_EHI.shape[2]
    x_sorted_MH, offsets_E1, _ = permute_reference(x_TH, ids_Tk, experts)
    bounds = offsets_E1.tolist()  # host copy once, outside the timed calls (a cuBLAS loop needs it)

    def cublas_loop():
        y_MH = torch.empty_like(x_sorted_MH)
        for e in range(experts):
            s, t = bounds[e], bounds[e + 1]
            if t > s:
                gate_up = x_sorted_MH[s:t] @ w13_E2IH[e].T
                y_MH[s:t] = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2_EHI[e].T
        return y_MH

    dense_a, dense_b = w13_E2IH[0].T.contiguous(), w2_EHI[0].T.contiguous()
    ms = {
        "grouped_gemm": median_ms(lambda: fused_experts(x_sorted_MH, offsets_E1, w13_E2IH, w2_EHI, backend=backend,
                                                        validate=False), cuda, 1, 3),
        "cublas_loop": median_ms(cublas_loop, cuda, 1, 3),
        # the same FLOPs through one weight pair: what cuBLAS reaches at this M with no expert split
        "dense": median_ms(lambda: (x_sorted_MH @ dense_a)[:, :inter] @ dense_b, cuda, 1, 3),
        "layer": median_ms(lambda: fused_moe(x_TH, ids_Tk, weights_Tk, w13_E2IH, w2_EHI, backend=backend,
                                             validate=False), cuda, 1, 3),
    }
    if vllm_fn is not None:
        ids32 = ids_Tk.to(torch.int32)
        ms["vllm"] = median_ms(lambda: vllm_fn(x_TH, w13_E2IH, w2_EHI, weights_Tk, ids32), cuda, 1, 3)
    return ms, x_sorted_MH.shape[0]


def expert_rows(tokens_list, dtype: torch.dtype, device: str, scale: int = 1) -> list[dict]:
    """Timing rows of the fair baselines (see the module docstring); scale divides H and I (dry runs)."""
    cuda = device == "cuda"
    vllm_fn, vllm_missing = vllm_fused_experts() if cuda else (None, "dry run: vllm not tried")
    dtype_name = str(dtype).removeprefix("torch.")
    rows = []
    for name, (hidden, inter, experts, top_k) in EXPERT_SHAPES.items():
        hidden, inter = hidden // scale, inter // scale
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
        for num_tokens in tokens_list:
            x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
            ids = torch.rand(num_tokens, experts, generator=g).topk(top_k, dim=1).indices.to(device)
            topk_w = torch.rand(num_tokens, top_k, generator=g).to(device)
            ms, rows_m = baseline_ms(x, ids, topk_w, w13, w2, cuda, vllm_fn)
            flops = 6.0 * rows_m * hidden * inter
            tflops = {k: round(flops / v / 1e9, 2) for k, v in ms.items()}
            dense_fraction = {k: round(ms["dense"] / v, 3) for k, v in ms.items() if k != "dense"}
            note = f"tflops {json.dumps(tflops)}; dense_ms / kernel_ms {json.dumps(dense_fraction)}"
            shape = f"{name} H{hidden} I{inter} E{experts} k{top_k} M{rows_m}"
            rows.append(row("grouped_gemm_vs_cublas_loop", shape, dtype_name, num_tokens, ms["grouped_gemm"],
                            ms["cublas_loop"], note=note))
            rows.append(row("moe_layer_vs_vllm", shape, dtype_name, num_tokens, ms["layer"], ms.get("vllm"),
                            note=vllm_missing or "torch_ms: vllm fused_experts (routing given)"))
    return rows


def experts_ms(n: int, w13_E2IH, w2_EHI, cuda: bool, generator: torch.Generator) -> float:
    """Median ms of one grouped call of all E experts' SwiGLU MLPs over n rows each (Triton on CUDA, the torch
    reference otherwise)."""
    from repro.kernels.grouped_gemm import fused_experts

    experts = w2_EHI.shape[0]
    x = torch.randn(n * experts, w2_EHI.shape[1], generator=generator).to(w13_E2IH.device, w13_E2IH.dtype)
    offsets = torch.arange(experts + 1, device=w13_E2IH.device) * n
    backend = "triton" if cuda else "torch"
    return median_ms(lambda: fused_experts(x, offsets, w13_E2IH, w2_EHI, backend=backend, validate=False), cuda, 1, 3)


# experts one rank of the 8-GPU profiles holds (E / 8): the slots one grouped-GEMM launch serves there
CALIBRATION_RANKS = 8


def measured_expert_gemm(dtype: torch.dtype, device: str, scale: int = 1, row_counts=CALIBRATION_ROWS) -> dict:
    """{"expert_gemm": {shape name: [[rows of one expert, seconds], ...]}}: the table repro.sim.hardware reads
    from a hardware profile's `measured:` section.

    The simulator sums the table over a rank's expert slots, so one entry is a slot's share of one grouped call
    over the E / 8 experts of a rank with n rows each (the call's time / its experts): the launch is paid once per
    rank, not once per expert, as in the kernel."""
    tables = {}
    for name, (hidden, inter, experts, _) in EXPERT_SHAPES.items():
        hidden, inter, local = hidden // scale, inter // scale, max(1, experts // CALIBRATION_RANKS)
        g = torch.Generator().manual_seed(1)
        w13 = (torch.randn(local, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
        w2 = (torch.randn(local, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
        tables[name] = [[n, experts_ms(n, w13, w2, device == "cuda", g) * 1e-3 / local] for n in row_counts]
    return {"expert_gemm": tables}


GENERATED_BY = "bench.gpu_check"


def gpu_profile_name(device_name: str) -> str:
    """The hardware profile a GPU model's measurements belong to: 'NVIDIA H200' -> 'h200',
    'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100'; otherwise the name as a slug."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper())
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower().removeprefix("nvidia")).strip("_") or "gpu"


def launch_overhead(cuda: bool) -> dict:
    """{"kernel_floor_us": median us of the smallest kernel call with work (one row through a one-expert grouped
    GEMM, H = I = 64: launch, ramp and tail), "launch_us": host us per launch of a one-element add, 1,000 back to
    back (the rate a host can issue kernels)}; torch references on the CPU."""
    g = torch.Generator().manual_seed(2)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    w13 = (torch.randn(1, 128, 64, generator=g) / 8).to(device, dtype)
    w2 = (torch.randn(1, 64, 64, generator=g) / 8).to(device, dtype)
    floor_ms = experts_ms(1, w13, w2, cuda, g)
    x = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(10):
        x.add_(1)
    sync()
    start = time.perf_counter()
    for _ in range(1000):
        x.add_(1)
    sync()
    return {"kernel_floor_us": round(floor_ms * 1e3, 3), "launch_us": round((time.perf_counter() - start) * 1e3, 3)}


def expert_tflops(expert_gemm: dict, scale: int = 1) -> dict:
    """{shape: {rows: achieved TFLOP/s}} of the expert GEMM tables (6 H I flops per row: gate, up, down)."""
    out = {}
    for name, table in expert_gemm.items():
        hidden, inter = EXPERT_SHAPES[name][0] // scale, EXPERT_SHAPES[name][1] // scale
        out[name] = {int(n): round(6.0 * n * hidden * inter / s / 1e12, 3) for n, s in table if s > 0}
    return out


def calibrate(name: str, device_label: str, cuda: bool, dtype: torch.dtype, scale: int = 1,
              row_counts=CALIBRATION_ROWS, a2a_ranks: int = 0, peer_bytes=A2A_PEER_BYTES,
              repeats: int = A2A_REPEATS) -> dict:
    """The calibration document repro.sim.hardware merges (see the module docstring); a part that raises is named
    in notes and left out, so one broken measurement keeps the others."""
    device = "cuda" if cuda else "cpu"
    measured: dict = {}
    notes: dict = {"device": device_label, "torch": str(torch.__version__)}
    try:
        measured |= measured_expert_gemm(dtype, device, scale, row_counts)
        notes["expert_gemm"] = (f"per expert slot: one {'Triton' if cuda else 'torch reference'} grouped-GEMM call "
                                f"over a rank's E / {CALIBRATION_RANKS} experts with n rows each / its experts, "
                                f"{str(dtype).removeprefix('torch.')}, median")
        notes["expert_gemm_tflops"] = expert_tflops(measured["expert_gemm"], scale)
    except Exception as e:  # keep the other parts
        traceback.print_exc()
        notes["expert_gemm"] = f"failed: {type(e).__name__}: {e}".splitlines()[0]
    try:
        overhead = launch_overhead(cuda)
        measured["kernel_floor_us"] = overhead["kernel_floor_us"]
        notes["launch_us"] = overhead["launch_us"]
    except Exception as e:
        traceback.print_exc()
        notes["kernel_floor_us"] = f"failed: {type(e).__name__}: {e}".splitlines()[0]
    if a2a_ranks >= 2:
        try:
            table = measure_a2a(a2a_ranks, cuda, peer_bytes, repeats)
            # an even all-to-all: dispatch and combine are the same collective at the same bytes
            measured["a2a"] = {"nccl": {"dispatch": table, "combine": [list(r) for r in table]}}  # no YAML alias
            notes["a2a"] = {"backend": "nccl" if cuda else "gloo (dry run, filed under nccl)", "ranks": a2a_ranks,
                            **a2a_summary(table)}
        except Exception as e:
            traceback.print_exc()
            notes["a2a"] = f"failed: {type(e).__name__}: {e}".splitlines()[0]
    else:
        notes["a2a"] = "not measured: one GPU here (an all-to-all needs two or more)"
    notes["deepep"] = ("installed, not driven by this script: deepep_* stay on their formulas"
                       if importlib.util.find_spec("deep_ep") else "not installed")
    return {"name": name, "generated_by": GENERATED_BY, "ranks": a2a_ranks if "a2a" in measured else 1,
            "notes": notes, "measured": measured}


def write_measured_profile(path: Path, document: dict) -> None:
    """Write a calibration document as YAML, atomically; a file there that this script did not write is kept."""
    if path.exists():
        try:
            previous = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            previous = None
        if not isinstance(previous, dict) or previous.get("generated_by") != GENERATED_BY:
            raise ConfigError(f"{path} exists and was not written by {GENERATED_BY}; move it away or pass another "
                              "--measured-dir, then run again.")
    header = (f"# Written by {GENERATED_BY} (make gpu-check) on {document['notes'].get('device')}; "
              f"repro.sim.hardware merges `measured` into conf/hardware/{document['name']}.yaml's.\n"
              "# Regenerate rather than edit. notes are for people; the simulator reads `measured` and `ranks`.\n")
    atomic_write_text(path, header + yaml.safe_dump(document, sort_keys=False, default_flow_style=None, width=110))


# a representative load (rows per expert) for each DEFAULT_TILES bucket of repro.kernels.grouped_gemm
TUNE_ROWS_PER_EXPERT = {16: 8, 64: 48, 256: 192, 2**62: 1024}


def tune_tiles(shapes: dict, dtype: torch.dtype, device: str) -> dict:
    """{tuned_key: {bucket: [BM, BN, BK, GM, warps, stages]}}: per expert shape (name -> (H, I, E, k)) and
    rows-per-expert bucket, the CANDIDATE_TILES config with the least median time of fused_experts over evenly
    loaded experts (the file format repro.kernels.grouped_gemm.load_tuned reads)."""
    from repro.kernels.grouped_gemm import CANDIDATE_TILES, fused_experts, tuned_key

    cuda = device == "cuda"
    table = {}
    for hidden, inter, experts, _ in shapes.values():
        g = torch.Generator().manual_seed(3)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
        buckets = {}
        for bucket, rows in TUNE_ROWS_PER_EXPERT.items():
            x = torch.randn(rows * experts, hidden, generator=g).to(device, dtype)
            offsets = torch.arange(experts + 1, device=device) * rows
            call = functools.partial(fused_experts, x, offsets, w13, w2, backend="triton" if cuda else "torch",
                                     validate=False)
            ms = {tile: median_ms(functools.partial(call, config=tile), cuda, 0, 1) for tile in CANDIDATE_TILES}
            buckets[str(bucket)] = list(min(ms, key=ms.get))
        table[tuned_key(experts, hidden, inter, dtype)] = buckets
    return table


def write_tuned(path: Path, table: dict) -> None:
    """Merge `table` into the tuned-config JSON at `path` (other shapes' entries kept), atomically."""
    from repro.kernels.grouped_gemm import load_tuned

    load_tuned.cache_clear()
    load_tuned(path)  # an existing file must parse (ConfigError otherwise) before it is rewritten
    previous = json.loads(path.read_text()) if path.is_file() else {}
    atomic_write_text(path, json.dumps(previous | table, indent=1, sort_keys=True) + "\n")
    load_tuned.cache_clear()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json and gpu_check.csv")
    parser.add_argument("--tokens", type=cli.positive, nargs="+", default=list(TOKENS), help="tokens per step T")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="data dtypes")
    parser.add_argument("--measured-dir", type=Path, default=None,
                        help=f"where <name>.yaml goes for the simulator (default {MEASURED_DIR}; not in a dry run)")
    parser.add_argument("--name", default=None, help="hardware profile name (default: from the GPU model, e.g. h200)")
    parser.add_argument("--tune", action="store_true",
                        help="tune the grouped GEMM's tile per shape and bucket into repro/kernels/configs/, then exit")
    parser.add_argument("--skip-correctness", action="store_true",
                        help="only the baselines and the calibration (the kernel tests check correctness)")
    parser.add_argument("--dry-run", action="store_true",
                        help="rehearse on the CPU: torch references, shapes / 64, fp32; numbers are not calibration")
    args = parser.parse_args(argv)
    if min(args.tokens) < SHUFFLE["ranks"]:
        parser.error(f"--tokens must be >= {SHUFFLE['ranks']} (a token per TP rank of the shuffle plan)")
    if args.dry_run and args.tune:
        parser.error("--tune times compiled kernels on a GPU; it has no dry run")
    if args.dry_run and args.measured_dir is not None:
        parser.error("--measured-dir is for GPU runs; a dry run writes its rehearsal file under --out/measured only")
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name):
        parser.error(f"--name must be a file stem (letters, digits, _ . -), got {args.name!r}")
    return args


def write_calibration(document: dict, out: Path, measured_dir: Path | None) -> list[Path]:
    """DIR/measured/<name>.yaml always, and measured_dir/<name>.yaml when given: the paths written."""
    paths = [out / "measured" / f"{document['name']}.yaml"] + (
        [measured_dir / f"{document['name']}.yaml"] if measured_dir is not None else [])
    for path in paths:
        write_measured_profile(path, document)
    return paths


def dry_run(out: Path, name: str | None) -> int:
    """The baseline and calibration steps on the CPU at 1/64 of the shapes (no Triton): files, not numbers."""
    meta = {"dry_run": True, "device": "cpu", "note": "CPU rehearsal with torch references; not calibration",
            "torch": torch.__version__, "python": platform.python_version()}
    rows = expert_rows((16,), torch.float32, "cpu", scale=64)
    measured = measured_expert_gemm(torch.float32, "cpu", scale=64, row_counts=(1, 16, 256))
    atomic_write_text(out / "measured.json", json.dumps(measured, indent=1) + "\n")
    document = calibrate(name or "cpu_dry_run", "cpu (dry run: torch references, not calibration)", False,
                         torch.float32, scale=64, row_counts=(1, 16, 256), a2a_ranks=2,
                         peer_bytes=(64, 1024, 16384), repeats=3)
    document["notes"]["dry_run"] = True
    paths = write_calibration(document, out, None)
    meta["measured"] = {"paths": [str(p) for p in paths], "notes": document["notes"]}
    write_results(out, meta, rows)
    missing = sorted(k for k in ("expert_gemm", "kernel_floor_us", "a2a") if k not in document["measured"])
    print(f"dry run: {len(rows)} rows -> {out / 'gpu_check.json'}, {', '.join(map(str, paths))} (CPU references "
          f"only){'; FAILED: ' + ', '.join(missing) if missing else ''}")
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args.out, args.name)
    problem = usable_gpu()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import triton

    started = time.perf_counter()
    device_name = torch.cuda.get_device_name()
    if args.tune:
        from repro.kernels.grouped_gemm import config_file

        table = tune_tiles(EXPERT_SHAPES, torch.bfloat16, "cuda")
        path = config_file(device_name)
        write_tuned(path, table)
        atomic_write_text(args.out / "tuned_tiles.json", json.dumps(table, indent=1) + "\n")
        print(f"tuned {len(table)} shapes in {time.perf_counter() - started:.0f} s -> {path}")
        return 0
    meta = {
        "device": device_name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "timing": "triton.testing.do_bench, median ms of one call (CUDA events, L2 flushed between calls)",
        "speedup": "torch_ms / triton_ms (> 1: Triton faster)",
        "tolerances": {str(k).removeprefix("torch."): v for k, v in TOLERANCES.items()} | {"integer": "exact"},
        "tokens": args.tokens, "dtypes": args.dtypes,
    }
    rows: list[dict] = []
    for num_tokens in [] if args.skip_correctness else args.tokens:
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
    try:
        rows += expert_rows(BASELINE_TOKENS, torch.bfloat16, "cuda")
    except Exception as e:  # timing rows: record why they are missing, keep the correctness results
        traceback.print_exc()
        rows.append(row("expert_baselines", "", "bf16", 0, None, None, note=f"{type(e).__name__}: {e}"))
    calibration_failed = False
    try:
        measured = measured_expert_gemm(torch.bfloat16, "cuda")
        measured_path = args.out / "measured.json"
        atomic_write_text(measured_path, json.dumps(measured, indent=1) + "\n")
        gpus = torch.cuda.device_count()
        document = calibrate(args.name or gpu_profile_name(device_name), device_name, True, torch.bfloat16,
                             a2a_ranks=gpus if gpus >= 2 else 0)
        paths = write_calibration(document, args.out, args.measured_dir or MEASURED_DIR)
        calibration_failed = any(str(v).startswith("failed") for v in document["notes"].values())
        meta["measured"] = {"path": str(measured_path), "profile": [str(p) for p in paths], "notes": document["notes"]}
        print(f"calibration -> {', '.join(map(str, paths))}: {json.dumps(document['notes'])}", flush=True)
    except Exception as e:
        traceback.print_exc()
        calibration_failed = True
        meta["measured"] = f"failed: {type(e).__name__}: {e}"
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_results(args.out, meta, rows)
    failed = [r for r in rows if r["passed"] is False]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows ok, {len(failed)} failed, calibration "
          f"{'FAILED' if calibration_failed else 'ok'}, {meta['elapsed_s']} s -> {args.out / 'gpu_check.json'}")
    return 1 if failed or calibration_failed else 0


if __name__ == "__main__":
    sys.exit(main())
