"""One expert-parallel MoE layer over torch.distributed, with every byte on the wire counted.

Legend: T tokens on this rank, H hidden, k experts per token, E logical experts, D ranks, S physical expert slots
on this rank, I expert intermediate size, C token copies this rank sends (one per token and destination rank),
R copies it receives, t tokens in this rank's reduce-scatter slice, P physical slots of a layer (all ranks).

Attention-DP (each rank owns its tokens):

    expert_rank_E = torch.as_tensor(placement.dispatch_device()[layer, rank])
    local = build_local_experts(placement.physical_to_logical[layer], rank, D, w13_E2IH, w2_EHI)
    record = CommRecord()
    y_TH = ep_moe_forward(x_TH, ids_Tk, weights_Tk, expert_rank_E, local, E, layer=layer, record=record,
                          backend="torch")

Attention-TP (every rank holds a partial sum of every token, Sem-MoE Algorithm 3):

    x_tH = shuffled_reduce_scatter(partial_TH, permutation_T, counts_D, layer=layer, record=record)
    y_tH = ep_moe_forward(x_tH, ids_T[slice], ...)            # this rank's slice: permutation_T[offset:offset+t]
    y_TH = shuffled_all_gather(y_tH, permutation_T, counts_D, layer=layer, record=record)

`group=None` is the default process group (all ranks). The kernels (repro.kernels.dispatch / grouped_gemm) are
imported when a layer runs; `backend` picks them: "auto" = Triton on CUDA tensors, the torch reference on CPU
(`resolve_kernel_backend`; the Triton interpreter is far too slow for multi-process runs, so "auto" never picks
it), "triton" or "torch" explicitly.

CommRecord counts, per (layer, collective), the bytes this rank SENT to other ranks (its chunk to itself is a
local copy and never touches the wire) and the wall seconds of the call: "counts" (per-rank copy counts),
"dispatch" (hidden states, one copy per token and destination rank: DeepEP's dedup, as the evaluator counts),
"dispatch_meta" (per copy: its k expert ids, -1 where the destination does not serve that slot, and k fp32
weights), "combine" (per-copy weighted partial sums back to the token's rank), "reduce_scatter" / "all_gather"
(the TP slices, padded to the largest slice as the collectives need: D - 1 padded slices leave each rank).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from repro.errors import ConfigError, ReproError

# torch 2.13 renamed the tensor forms of these collectives; older releases (>= 2.4, pyproject) have the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

COLLECTIVES = ("counts", "dispatch", "dispatch_meta", "combine", "reduce_scatter", "all_gather")


# ---- inputs --------------------------------------------------------------------------------------------------


def resolve_kernel_backend(backend: str, device: torch.device) -> str:
    """"triton" or "torch" for kernels on `device`: "auto" = triton on CUDA, torch on the CPU.

    Raises ConfigError for an unknown name and for triton on the CPU without TRITON_INTERPRET=1.
    """
    from repro.kernels import BACKENDS, interpreter_on

    if backend not in BACKENDS:
        raise ConfigError(f"exec kernel backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not interpreter_on():
        raise ConfigError(
            "exec kernel backend triton needs a GPU (or TRITON_INTERPRET=1, far too slow for multi-process runs); "
            "use kernel backend torch or auto on the CPU."
        )
    return backend


@dataclass(frozen=True)
class LocalExperts:
    """The experts one rank serves in one layer: slot s holds logical expert slot_experts_S[s].

    slot_experts_S int64[S]; w13_S2IH [S, 2I, H] (gate rows then up rows); w2_SHI [S, H, I]. A replicated
    expert has its own slot (and its own copy of the weights) on each rank that holds it.
    """

    slot_experts_S: torch.Tensor
    w13_S2IH: torch.Tensor
    w2_SHI: torch.Tensor

    def slot_of_expert(self, num_experts: int) -> torch.Tensor:
        """int64[E] this rank's first slot of each logical expert, -1 for experts it does not hold."""
        slots = torch.arange(len(self.slot_experts_S), device=self.slot_experts_S.device)
        out = torch.full((num_experts,), len(slots), dtype=torch.int64, device=slots.device)
        out.scatter_reduce_(0, self.slot_experts_S, slots, reduce="amin")  # two local replicas: the first serves
        return torch.where(out == len(slots), -1, out)


def build_local_experts(physical_to_logical_P, rank: int, num_ranks: int, w13_E2IH: torch.Tensor,
                  w2_EHI: torch.Tensor) -> LocalExperts:
    """LocalExperts of `rank` from one layer's placement row int[P] (SGLang rule: slot p on rank p // (P / D)).

    w13_E2IH [E, 2I, H], w2_EHI [E, H, I]: every logical expert's weights; each slot gets a copy of its expert's.
    """
    row_P = torch.as_tensor(np.asarray(physical_to_logical_P), dtype=torch.int64)
    if row_P.ndim != 1 or len(row_P) % num_ranks:
        raise ConfigError(
            f"a placement row of {tuple(row_P.shape)} slots does not split over {num_ranks} ranks; pass one layer's "
            "physical_to_logical row with a multiple of the world size slots."
        )
    slots_S = row_P.view(num_ranks, -1)[rank].to(w13_E2IH.device)
    return LocalExperts(slots_S, w13_E2IH[slots_S].contiguous(), w2_EHI[slots_S].contiguous())


# ---- what went over the wire ---------------------------------------------------------------------------------


@dataclass
class CommRecord:
    """Bytes this rank sent to other ranks and wall seconds, summed per (layer, collective name).

    barrier=True puts an (untimed) barrier before each timed collective, so its seconds hold the transfer alone
    rather than also the wait for the last rank to arrive (load imbalance); it changes timing, never bytes.
    """

    barrier: bool = False
    sent_bytes: dict = field(default_factory=dict)  # (layer, name) -> int
    seconds: dict = field(default_factory=dict)  # (layer, name) -> float
    calls: dict = field(default_factory=dict)  # (layer, name) -> int

    def add(self, layer: int, name: str, nbytes: int, seconds: float) -> None:
        key = (int(layer), name)
        self.sent_bytes[key] = self.sent_bytes.get(key, 0) + int(nbytes)
        self.seconds[key] = self.seconds.get(key, 0.0) + float(seconds)
        self.calls[key] = self.calls.get(key, 0) + 1

    def bytes_of(self, layer: int, name: str) -> int:
        return self.sent_bytes.get((int(layer), name), 0)

    def total_bytes(self, name: str) -> int:
        return sum(b for (_, n), b in self.sent_bytes.items() if n == name)

    def total_seconds(self, name: str) -> float:
        return sum(s for (_, n), s in self.seconds.items() if n == name)

    def bytes_per_layer(self, name: str, num_layers: int) -> list[int]:
        """int per layer 0..num_layers-1 of collective `name` (0 where it never ran)."""
        return [self.bytes_of(layer, name) for layer in range(num_layers)]

    def seconds_per_layer(self, name: str, num_layers: int) -> list[float]:
        return [self.seconds.get((layer, name), 0.0) for layer in range(num_layers)]

    def to_json(self) -> list[dict]:
        """JSON-ready rows {layer, collective, bytes, seconds, calls}, by layer then in COLLECTIVES order (what a
        worker returns; `from_json` reads it back)."""
        keys = sorted(self.sent_bytes, key=lambda key: (key[0], COLLECTIVES.index(key[1])))
        return [
            {"layer": layer, "collective": name, "bytes": self.sent_bytes[(layer, name)],
             "seconds": self.seconds[(layer, name)], "calls": self.calls[(layer, name)]}
            for layer, name in keys
        ]

    @classmethod
    def from_json(cls, rows: list[dict]) -> CommRecord:
        record = cls()
        for row in rows:
            key = (int(row["layer"]), row["collective"])
            record.sent_bytes[key], record.seconds[key], record.calls[key] = row["bytes"], row["seconds"], row["calls"]
        return record


@contextlib.contextmanager
def _timed(record: CommRecord | None, layer: int, name: str, nbytes: int, device: torch.device, group):
    """Time the enclosed collective into record (synchronising CUDA so the seconds are the transfer's)."""
    if record is None:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if record.barrier:
        dist.barrier(group=group)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    record.add(layer, name, nbytes, time.perf_counter() - start)


# ---- Attention-DP / EP step ----------------------------------------------------------------------------------


def ep_moe_forward(
    x_TH: torch.Tensor,
    topk_ids_Tk: torch.Tensor,
    topk_weights_Tk: torch.Tensor,
    expert_rank_E: torch.Tensor,
    local: LocalExperts,
    num_experts: int,
    group=None,
    *,
    layer: int,
    record: CommRecord | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """y_TH = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) for this rank's T tokens (T may be 0), experts served
    across the group.

    topk_ids_Tk int (logical ids in 0..E-1), topk_weights_Tk float; expert_rank_E int[E]: the rank this rank
    sends each expert's tokens to (Placement.dispatch_device()[layer, rank]); local: this rank's slots. Each
    token travels once to each destination rank with its ids there (others -1) and weights; the receiver runs
    its slots and returns one weighted partial sum per copy, which this rank adds up per token (fp32).
    Every rank of the group must call this the same number of times (collectives).
    validate=False skips the input checks that read device values (the kernels' and the received-slot check);
    the all-to-all split sizes still go to the host once per layer (NCCL's uneven all_to_all_single needs
    them), so this path syncs exactly there.
    """
    from repro.kernels.dispatch import dispatch_layout, permute, unpermute
    from repro.kernels.grouped_gemm import fused_experts

    device = x_TH.device
    backend = resolve_kernel_backend(backend, device)
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    hidden, top_k = x_TH.shape[1], topk_ids_Tk.shape[1]
    topk_ids_Tk = topk_ids_Tk.to(device=device, dtype=torch.int64)
    expert_rank_E = torch.as_tensor(expert_rank_E, device=device, dtype=torch.int64)

    layout = dispatch_layout(topk_ids_Tk, expert_rank_E, num_ranks, backend=backend, validate=validate)
    send_D = layout.tokens_per_rank_D.to(device=device, dtype=torch.int64)
    recv_D = torch.empty_like(send_D)
    with _timed(record, layer, "counts", (num_ranks - 1) * send_D.element_size(), device, group):
        dist.all_to_all_single(recv_D, send_D, group=group)
    send_splits, recv_splits = send_D.tolist(), recv_D.tolist()
    num_sent, num_received = sum(send_splits), sum(recv_splits)
    remote_sent, remote_received = num_sent - send_splits[rank], num_received - recv_splits[rank]

    # one copy per (token, destination rank), at the row dispatch_layout gave it in the rank-major buffer
    copy_position_TD = layout.copy_position_TD.to(device)
    token_C, dest_C = torch.nonzero(copy_position_TD >= 0, as_tuple=True)
    row_C = copy_position_TD[token_C, dest_C]
    x_send_CH = x_TH.new_empty((num_sent, hidden))
    x_send_CH[row_C] = x_TH[token_C]
    ids_Ck = topk_ids_Tk[token_C]
    ids_Ck = torch.where(expert_rank_E[ids_Ck] == dest_C[:, None], ids_Ck, -1)
    # ids and fp32 weights travel in one int32 message: [ids | weight bits]
    meta_send_C2k = torch.empty((num_sent, 2 * top_k), dtype=torch.int32, device=device)
    meta_send_C2k[row_C] = torch.cat([ids_Ck.to(torch.int32), topk_weights_Tk[token_C].to(device, torch.float32)
                                      .view(torch.int32)], dim=1)

    x_recv_RH = x_TH.new_empty((num_received, hidden))
    with _timed(record, layer, "dispatch", remote_sent * hidden * x_TH.element_size(), device, group):
        dist.all_to_all_single(x_recv_RH, x_send_CH, recv_splits, send_splits, group=group)
    meta_recv_R2k = meta_send_C2k.new_empty((num_received, 2 * top_k))
    with _timed(record, layer, "dispatch_meta", remote_sent * 2 * top_k * meta_send_C2k.element_size(), device, group):
        dist.all_to_all_single(meta_recv_R2k, meta_send_C2k, recv_splits, send_splits, group=group)

    ids_Rk = meta_recv_R2k[:, :top_k].to(torch.int64)
    weights_Rk = meta_recv_R2k[:, top_k:].contiguous().view(torch.float32)
    slot_of_expert_E = local.slot_of_expert(num_experts).to(device)
    slots_Rk = torch.where(ids_Rk >= 0, slot_of_expert_E[ids_Rk.clamp(min=0)], -1)
    if validate and bool(((slots_Rk < 0) & (ids_Rk >= 0)).any()):
        expert = int(ids_Rk[(slots_Rk < 0) & (ids_Rk >= 0)][0])
        raise ReproError(
            f"rank {rank} received tokens for expert {expert} in layer {layer} but holds no slot of it; build "
            "expert_rank_E and the local experts from the same placement."
        )
    x_sorted_MH, offsets_S1, position_Rk = permute(x_recv_RH, slots_Rk, len(local.slot_experts_S), backend=backend,
                                                   validate=validate)
    y_sorted_MH = fused_experts(x_sorted_MH, offsets_S1, local.w13_S2IH, local.w2_SHI, backend=backend,
                                validate=validate)
    partial_RH = unpermute(y_sorted_MH, position_Rk, weights_Rk, backend=backend, validate=validate)

    partial_RH = partial_RH.to(x_TH.dtype).contiguous()
    back_CH = x_TH.new_empty((num_sent, hidden))
    with _timed(record, layer, "combine", remote_received * hidden * x_TH.element_size(), device, group):
        dist.all_to_all_single(back_CH, partial_RH, send_splits, recv_splits, group=group)
    out_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=device)
    out_TH.index_add_(0, token_C, back_CH[row_C].float())
    return out_TH.to(x_TH.dtype)


# ---- Attention-TP: shuffled reduce-scatter and all-gather ----------------------------------------------------


def _slices(permutation_T, counts_D, device: torch.device):
    """(permutation int64[T], counts list[D], rank_of_position int64[T], row_in_slice int64[T], largest slice)."""
    permutation_T = torch.as_tensor(np.asarray(permutation_T), dtype=torch.int64, device=device)
    counts = [int(c) for c in np.asarray(counts_D)]
    counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
    rank_of_position_T = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t)
    starts_D = torch.cumsum(counts_t, 0) - counts_t
    row_in_slice_T = torch.arange(len(permutation_T), device=device) - starts_D[rank_of_position_T]
    return permutation_T, counts, rank_of_position_T, row_in_slice_T, max(counts, default=0)


def shuffled_reduce_scatter(
    partial_x_TH: torch.Tensor, permutation_T, counts_D, group=None, *, layer: int, record: CommRecord | None = None
) -> torch.Tensor:
    """x_slice_tH: the summed hidden states of this rank's tokens permutation_T[sum(counts[:r]) : sum(counts[:r+1])].

    partial_x_TH: this rank's partial sum of every token (e.g. its row-parallel attention output); permutation_T
    int[T] and counts_D int[D] from plan.shuffle_tokens (identical on every rank). Slices are padded to the
    largest count for reduce_scatter_tensor and unpadded after.
    """
    device = partial_x_TH.device
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    permutation_T, counts, rank_of_T, row_of_T, largest = _slices(permutation_T, counts_D, device)
    padded_DtH = partial_x_TH.new_zeros((num_ranks, largest, partial_x_TH.shape[1]))
    padded_DtH[rank_of_T, row_of_T] = partial_x_TH[permutation_T]
    out_tH = partial_x_TH.new_empty((largest, partial_x_TH.shape[1]))
    nbytes = (num_ranks - 1) * out_tH.numel() * out_tH.element_size()
    with _timed(record, layer, "reduce_scatter", nbytes, device, group):
        _reduce_scatter(out_tH, padded_DtH.view(-1, partial_x_TH.shape[1]), group=group)
    return out_tH[: counts[rank]]


def shuffled_all_gather(
    y_slice_tH: torch.Tensor, permutation_T, counts_D, group=None, *, layer: int, record: CommRecord | None = None
) -> torch.Tensor:
    """y_TH: every rank's slice gathered and put back in token order (the inverse of the reduce-scatter's shuffle).

    y_slice_tH: this rank's tokens in slice order, t = counts_D[rank]; same permutation_T and counts_D as the
    matching shuffled_reduce_scatter.
    """
    device = y_slice_tH.device
    num_ranks = dist.get_world_size(group)
    permutation_T, counts, rank_of_T, row_of_T, largest = _slices(permutation_T, counts_D, device)
    hidden = y_slice_tH.shape[1]
    padded_tH = y_slice_tH.new_zeros((largest, hidden))
    padded_tH[: len(y_slice_tH)] = y_slice_tH
    gathered_DtH = y_slice_tH.new_empty((num_ranks, largest, hidden))
    nbytes = (num_ranks - 1) * padded_tH.numel() * padded_tH.element_size()
    with _timed(record, layer, "all_gather", nbytes, device, group):
        _all_gather(gathered_DtH.view(-1, hidden), padded_tH, group=group)
    y_TH = y_slice_tH.new_empty((len(permutation_T), hidden))
    y_TH[permutation_T] = gathered_DtH[rank_of_T, row_of_T]
    return y_TH
