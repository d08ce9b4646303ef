"""One MoE layer through the Triton kernels (repro.kernels.moe_layer) against moe_reference, at scale: grids of
many row blocks per expert and several n-blocks (grouped-M swizzle), the gathered GEMM beside the permuted one,
every tile config, the Sem-MoE align step up to and past its one-program limit, and no host sync on the hot path.

Runs where tests/kernel_device.py says (interpreter on a CPU, compiled on CUDA). Tolerances as test_kernels_gemm
(absolute, scaled by the largest reference output): fp32 1e-5, fp16 2e-3.
Legend: T tokens, H hidden, I intermediate, E experts, k experts per token, M routed rows.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_device import COMPILED, KERNEL_DEVICE, compiled_only, interpreter_only, on_kernel_device
from test_kernels_shuffle import VOCAB, assert_same_as_plan, fitted_plan, step

from repro.errors import ConfigError, TraceError
from repro.kernels import dispatch, grouped_gemm, moe_layer, shuffle
from repro.kernels.grouped_gemm import (
    CANDIDATE_TILES,
    DEFAULT_TILES,
    INTERPRETER_TILE,
    TileConfig,
    fused_experts_reference,
    moe_reference,
    tile_config,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
fused_experts = on_kernel_device(grouped_gemm.fused_experts)
fused_experts_gathered = on_kernel_device(grouped_gemm.fused_experts_gathered)
fused_moe = on_kernel_device(moe_layer.fused_moe)
dispatch_layout = on_kernel_device(dispatch.dispatch_layout)
permute_positions = on_kernel_device(dispatch.permute_positions)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * scale


def weights(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def routing(num_tokens, num_experts, top_k, seed):
    """(ids int64[T, k], ~5 % skipped, expert 1 never picked (its picks go to 0); weights float32[T, k])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=g), dim=1)[:, :top_k]
    ids[ids == 1] = 0
    ids[torch.rand(num_tokens, top_k, generator=g) < 0.05] = -1
    return ids, torch.rand(num_tokens, top_k, generator=g)


# ---- grouped GEMM: many row blocks, several n-blocks, gather, every tile ------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_many_row_blocks_per_expert_and_swizzled_n_blocks(dtype):
    # 16-row blocks: 3 + 5 + 1 blocks of 3 experts (one empty), 2 n-blocks of the gate-up GEMM (I = 64) and
    # 2 of the down GEMM (H = 48); grouped-M groups of 4 blocks straddle experts
    rows = [40, 0, 70, 1]
    w13, w2 = weights(len(rows), 48, 64, dtype)
    offsets = torch.cumsum(torch.tensor([0, *rows]), 0)
    x = torch.randn(sum(rows), 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = fused_experts_reference(x, offsets, w13, w2)
    for group_m in (1, 4):
        tile = INTERPRETER_TILE._replace(group_m=group_m)
        assert_close(fused_experts(x, offsets, w13, w2, backend="triton", config=tile), want, dtype)
    # the same rows read through sorted slot ids: row r is x_T[slot // k], here k = 2 and rows reversed
    top_k, num_rows = 2, sum(rows)
    x_T = torch.randn(num_rows, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    slot = torch.arange(num_rows).flip(0) * top_k + 1
    got = fused_experts_gathered(x_T, slot, top_k, offsets, w13, w2, backend="triton")
    assert_close(got, fused_experts_reference(x_T[slot // top_k], offsets, w13, w2), dtype)


@pytest.mark.parametrize("tile", CANDIDATE_TILES, ids=lambda t: "x".join(map(str, t)))
def test_every_tile_config_is_valid(tile):
    # each config the compiled path may pick or the tuner may try: blocks past the rows, partial n- and k-blocks
    rows = [40, 0, 150]
    w13, w2 = weights(3, 96, 80, torch.float32, seed=3)
    offsets = torch.cumsum(torch.tensor([0, *rows]), 0)
    x = torch.randn(sum(rows), 96, generator=torch.Generator().manual_seed(4))
    got = fused_experts(x, offsets, w13, w2, backend="triton", config=tile)
    assert_close(got, fused_experts_reference(x, offsets, w13, w2), torch.float32)


def test_tile_config_choice_and_tuned_file(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    assert tile_config(10_000, 8, 1024, 512, torch.float16, cpu, interpreted=True) == INTERPRETER_TILE
    assert tile_config(8 * 16, 8, 1024, 512, torch.float16, cpu, interpreted=False) == DEFAULT_TILES[16]
    assert tile_config(8 * 17, 8, 1024, 512, torch.float16, cpu, interpreted=False) == DEFAULT_TILES[64]
    assert tile_config(8 * 10**6, 8, 1024, 512, torch.float16, cpu, interpreted=False) == DEFAULT_TILES[2**62]
    assert all(min(t.block_m, t.block_n, t.block_k) >= 16 for t in CANDIDATE_TILES)  # tl.dot's minimum
    # a tuned file for this device and shape wins over the defaults, by bucket
    path = tmp_path / "NVIDIA_H200.json"
    key = grouped_gemm.tuned_key(8, 1024, 512, torch.bfloat16)
    path.write_text(json.dumps({key: {"16": [16, 32, 64, 1, 4, 4], "1024": [128, 128, 64, 8, 8, 3]}}))
    monkeypatch.setattr(grouped_gemm, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(grouped_gemm, "_device_name", lambda device: "NVIDIA H200")
    assert grouped_gemm.config_file("NVIDIA H200") == path
    cuda = torch.device("cuda")
    assert tile_config(8 * 3, 8, 1024, 512, torch.bfloat16, cuda, interpreted=False) == TileConfig(16, 32, 64, 1, 4, 4)
    assert tile_config(8 * 500, 8, 1024, 512, torch.bfloat16, cuda, interpreted=False).block_m == 128
    assert tile_config(8 * 500, 8, 1024, 512, torch.float16, cuda, interpreted=False) == DEFAULT_TILES[2**62]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="tuned tile file .* is not valid"):
        grouped_gemm.load_tuned(bad)


# ---- the whole layer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_chain_matches_moe_reference(dtype):
    # permute -> grouped GEMM -> unpermute and the gathered form, each with and without validation
    num_tokens, num_experts, top_k = 70, 6, 2
    ids, topk_weights = routing(num_tokens, num_experts, top_k, seed=5)
    w13, w2 = weights(num_experts, 40, 24, dtype, seed=6)
    x = torch.randn(num_tokens, 40, generator=torch.Generator().manual_seed(7)).to(dtype)
    want = moe_reference(x, ids, topk_weights, w13, w2)
    for gather, validate in ((True, False), (False, True)):  # the hot-path test runs the other two
        got = fused_moe(x, ids, topk_weights, w13, w2, gather=gather, validate=validate, backend="triton")
        assert_close(got, want, dtype)
    assert torch.equal(moe_layer.fused_moe(x, ids, topk_weights, w13, w2, backend="torch"),
                       moe_layer.fused_moe(x, ids, topk_weights, w13, w2, gather=False, backend="torch"))


def test_unvalidated_permute_pads_rows_and_skips_out_of_range_ids():
    # validate=False: T * k rows (M unknown on the host), ids >= E skipped, not refused
    ids = torch.tensor([[0, 9], [1, 0], [-1, 2]])
    x = torch.arange(12.0).view(3, 4)
    permute = on_kernel_device(dispatch.permute)
    x_sorted, offsets, position = permute(x, ids, 3, backend="triton", validate=False)
    assert x_sorted.shape == (6, 4) and offsets.tolist() == [0, 2, 3, 4]
    assert position.tolist() == [[0, -1], [2, 1], [-1, 3]]
    assert torch.equal(x_sorted[:4], x[[0, 1, 1, 2]])
    with pytest.raises(ConfigError, match="1 topk_ids are >= the 3 experts"):
        permute(x, ids, 3, backend="triton")


@pytest.mark.slow
def test_fused_moe_at_4097_tokens():
    # T = 4097 (past one 1,024-token counting block of permute for E = 8): ~1,000 rows per expert, 16 blocks of 64
    # rows each; hidden sizes kept at 16 so the interpreter's cost is the grid, not the arithmetic
    num_tokens, num_experts, top_k = 4097, 8, 2
    ids, topk_weights = routing(num_tokens, num_experts, top_k, seed=8)
    w13, w2 = weights(num_experts, 16, 16, torch.float32, seed=9)
    x = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(10))
    want = moe_reference(x, ids, topk_weights, w13, w2)
    tile = TileConfig(64, 32, 32, 4, 4, 1)
    for gather, validate in ((False, True), (True, False)):
        got = fused_moe(x, ids, topk_weights, w13, w2, gather=gather, validate=validate, backend="triton", config=tile)
        assert_close(got, want, torch.float32)


def test_layout_and_positions_past_one_counting_block():
    # E = 16: 512-token counting blocks, so 4,097 tokens are 9 programs of each pass
    ids, _ = routing(4097, 16, 2, seed=11)
    ranks = torch.arange(16) % 4
    layout, reference = dispatch_layout(ids, ranks, 4, backend="triton"), dispatch.dispatch_layout_reference(ids, ranks, 4)
    assert all(torch.equal(a, b) for a, b in zip(layout, reference, strict=True))
    offsets, position = permute_positions(ids, 16, backend="triton", validate=False)
    _, ref_offsets, ref_position = dispatch.permute_reference(torch.zeros(4097, 0), ids, 16)
    assert torch.equal(offsets, ref_offsets) and torch.equal(position, ref_position)


# ---- the Sem-MoE align step at scale ---------------------------------------------------------------------------


# tl.sort of 4,096 keys takes ~25 s in the interpreter, of 8,192 (the one-CTA limit) ~60 s: the limit itself runs
# compiled only (make gpu-test); 4,096 covers the same sort in the interpreter
@pytest.mark.parametrize("num_tokens", [1000, pytest.param(4096, marks=pytest.mark.slow),
                                        pytest.param(shuffle.MAX_SORT_TOKENS, marks=compiled_only), 9000])
def test_align_step_at_scale(num_tokens):
    # one program of kernel 2 up to MAX_SORT_TOKENS = 8,192 (the limit: one CTA holds the step), the torch align
    # past it; both equal the plan's numpy Algorithm 3 bit for bit
    plan = fitted_plan(4, 2)
    tokens, prev = step(np.random.default_rng(num_tokens), num_tokens, 2)
    tokens[: num_tokens // 3] = tokens[0]  # a crowded device, so align moves tokens
    assert_same_as_plan(plan, tokens, 2, prev)
    assert plan.info["align_moved_tokens"] > 0


# ---- no host sync on the hot path ------------------------------------------------------------------------------

REPRO = str(Path(grouped_gemm.__file__).resolve().parents[1])
SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
SYNCING_FUNCTIONS = ("nonzero", "unique", "bincount", "masked_select", "repeat_interleave")


@pytest.fixture
def host_syncs(monkeypatch):
    """A list that collects 'name at file:line' for every call from repro/ code of a tensor method or torch
    function that reads device values on the host (a CUDA sync), or of a boolean-mask index (its size needs
    the count). Calls from torch or Triton themselves (the interpreter copies to numpy) are not counted."""
    calls: list[str] = []

    def counted(name, original):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(REPRO) and not (
                name == "repeat_interleave" and kwargs.get("output_size") is not None
            ):
                calls.append(f"{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(*args, **kwargs)

        return wrapper

    def indexing(original):
        def wrapper(self, index):
            parts = index if isinstance(index, tuple) else (index,)
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(REPRO) and any(
                isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts
            ):
                calls.append(f"boolean mask at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(self, index)

        return wrapper

    for name in SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for name in SYNCING_FUNCTIONS:
        monkeypatch.setattr(torch, name, counted(name, getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "__getitem__", indexing(torch.Tensor.__getitem__))
    return calls


def run_hot_path(validate: bool, device: torch.device) -> None:
    """One MoE layer (gating, both GEMM forms) and the Sem-MoE shuffle (kernel and torch align) on device."""
    num_tokens, num_experts = 64, 6
    g = torch.Generator().manual_seed(12)
    w13, w2 = (w.to(device) for w in weights(num_experts, 32, 32, torch.float32))
    x = torch.randn(num_tokens, 32, generator=g).to(device)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(device)
    for gather in (True, False):
        moe_layer.moe_layer(x, logits, 2, w13, w2, gather=gather, backend="triton", validate=validate)
    plan = fitted_plan(4, 2)
    tokens, prev = step(np.random.default_rng(13), num_tokens, 2)
    tokens_T, prev_Thk = torch.from_numpy(tokens).to(device), torch.from_numpy(prev).to(device)
    shuffle.semmoe_shuffle(plan, tokens_T, 2, prev_Thk, backend="triton", validate=validate)
    shuffle.plan_tables(plan, device)  # uploaded once: already there
    topology_plan = fitted_plan(4, 1, devices_per_node=2)  # aligned by torch (by node, then by device)
    shuffle.semmoe_shuffle(topology_plan, tokens_T, 2, prev_Thk[:, 1:], backend="triton", validate=validate)


def test_hot_path_makes_no_host_sync(host_syncs):
    if KERNEL_DEVICE is None:
        pytest.skip("Triton kernels cannot run here (TRITON_INTERPRET=0 without a CUDA device)")
    fitted_plan(4, 2).reset()
    run_hot_path(True, KERNEL_DEVICE)
    checked = list(host_syncs)
    assert len(checked) >= 5, checked  # the counter sees the validation's syncs (it can fail)
    host_syncs.clear()
    run_hot_path(False, KERNEL_DEVICE)
    assert host_syncs == []
    if COMPILED:  # and the CUDA runtime agrees
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_hot_path(False, KERNEL_DEVICE)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_unvalidated_shuffle_counts_reach_plan_info_at_flush():
    plan = fitted_plan(3, 2)
    tokens, prev = step(np.random.default_rng(14), 100, 2)
    tokens[:50] = tokens[0]
    semmoe = on_kernel_device(shuffle.semmoe_shuffle)
    plan.reset()
    want = semmoe(plan, tokens, 2, prev, backend="triton")
    want_info = dict(plan.info)
    assert want_info["align_moved_tokens"] > 0
    plan.reset()
    got = semmoe(plan, tokens, 2, prev, backend="triton", validate=False)
    assert torch.equal(got[0], want[0]) and plan.info["shuffled_tokens"] == 0  # not yet counted
    shuffle.flush_shuffle_info(plan)
    assert plan.info == want_info
    shuffle.flush_shuffle_info(plan)  # nothing pending: unchanged
    assert plan.info == want_info
    with pytest.raises(TraceError, match="outside the plan's vocabulary"):
        semmoe(plan, np.array([VOCAB]), 0, None, backend="triton")


# ---- expert parallel over gloo with the Triton kernels ------------------------------------------------------------


def triton_ep_worker(rank, world_size):
    """2 ranks, 4 experts (2 per rank); each rank routes its own 40 tokens; Triton kernels in the interpreter."""
    from repro.exec.moe import build_local_experts, ep_moe_forward

    w13, w2 = weights(4, 16, 24, torch.float32, seed=15)
    ids, topk_weights = routing(80, 4, 2, seed=16)
    x = torch.randn(80, 16, generator=torch.Generator().manual_seed(17))
    mine = slice(40 * rank, 40 * rank + 40)
    local = build_local_experts(np.arange(4), rank, world_size, w13, w2)
    errors = {}
    for validate in (True, False):
        y = ep_moe_forward(x[mine], ids[mine], topk_weights[mine], torch.tensor([0, 0, 1, 1]), local, 4, layer=0,
                           backend="triton", validate=validate)
        want = moe_reference(x[mine], ids[mine], topk_weights[mine], w13, w2)
        errors[str(validate)] = float((y - want).abs().max() / want.abs().max())
    return errors


@interpreter_only
def test_ep_moe_forward_with_triton_kernels_on_gloo():
    # gloo ranks hold CPU tensors, so the Triton kernels run interpreted (on a GPU, repro.exec uses nccl)
    from repro.exec.launch import launch

    for errors in launch(triton_ep_worker, 2, timeout_s=120):
        assert max(errors.values()) <= 1e-5, errors


def test_gpu_check_measured_table_is_a_hardware_profiles_measured_section():
    # the format bench.gpu_check writes as measured.json is what repro.sim.hardware reads (CPU reference timings)
    import yaml

    from bench.gpu_check import EXPERT_SHAPES, measured_expert_gemm
    from repro.sim.hardware import load_hardware

    measured = measured_expert_gemm(torch.float32, "cpu", scale=256, row_counts=(1, 16))
    profile = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf/hardware/h200.yaml").read_text())
    hardware = load_hardware(profile | {"measured": measured})
    assert set(hardware.measured_expert_gemm) == set(EXPERT_SHAPES)
    assert {f"expert_gemm.{name}" for name in EXPERT_SHAPES} <= set(hardware.calibrated_parts)
