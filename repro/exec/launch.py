"""Start a torch.distributed process group and run one worker function per rank.

    from repro.exec.launch import launch
    results = launch(my_worker, 4, backend="gloo", timeout_s=60, n=3)   # list of 4 dicts, rank order

`my_worker(rank, world_size, **kwargs) -> dict` must be a module-level function (it is sent to spawned
processes by reference) and return something JSON-serialisable; the process group is already initialised when it
runs (`torch.distributed.get_rank()` works, the default group spans all ranks) and is torn down after it returns.

Two ways to run the same worker:
- `launch(worker, world_size, ...)`: this process spawns `world_size` workers on this machine (spawn context),
  with a TCP store it hosts itself on a free loopback port (no port race), and collects their dicts.
- `join(worker, ...)`: this process IS one rank of a job started by torchrun / SLURM (RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT in the environment; `in_torchrun()`); every rank gets every rank's dict, exchanged
  as JSON bytes over the group (nothing is unpickled). `init_from_env` starts the group early when the ranks
  must talk before the worker runs.

Kills: no rank outlives its driver. On Linux a tiny guardian process (GUARDIAN_CODE) learns each rank's pid as it
is spawned and SIGKILLs the ranks when the driver dies without saying "done" (its pipe closes): this covers the
seconds a rank spends importing torch before any code of ours runs in it. Each rank, once running, also asks Linux
to SIGKILL it when the driver dies (prctl PR_SET_PDEATHSIG) and exits when its parent pid changes (checked at start
and every second: the only guard off Linux). The multiprocessing resource tracker then exits too, as its pipe
closes. A SIGTERM to the driver while `launch` runs terminates the ranks (SIGKILL after TERMINATE_GRACE_S), then is
re-delivered to the handler that was there before (by default the driver then dies of it, status -15 / 143).

Faults: every collective of the group times out after `timeout_s`. If a rank raises or dies (os._exit, a kill),
its peers fail in their next collective (connection closed, or the timeout), `launch` waits for them at most
`timeout_s` more, stops any still running, and raises ReproError naming the rank that failed first and its error.
gloo workers get torch.set_num_threads(cpus // ranks on this node) so ranks do not fight over cores; NCCL workers
get cuda device rank % device_count (`worker_device(backend, rank)`; `launch` needs one GPU per rank).
"""

from __future__ import annotations

import ctypes
import datetime as dt
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from repro.errors import ConfigError, ReproError
from repro.exec_config import DIST_BACKENDS

TERMINATE_GRACE_S = 3.0  # after a SIGTERM to the driver, how long its ranks get to exit before SIGKILL
PARENT_POLL_S = 1.0  # how often a rank checks that its driver is still its parent
ORPHAN_EXIT_CODE = 1  # a rank whose driver is gone exits with this (nobody reads it)
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
HAS_PDEATHSIG = sys.platform.startswith("linux")
# Reads "pid" lines until "done" or EOF; at EOF (the driver died) it SIGKILLs each pid whose start time in /proc is
# still the one it read on registration (so a reused pid is never hit). Started with -I -S: ~20 ms, no repro import.
GUARDIAN_CODE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver, which stops its ranks itself
def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None
ranks = {}
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    ranks[int(line)] = started(int(line))
for pid, start in ranks.items():
    if start is not None and started(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def in_torchrun() -> bool:
    """True when torchrun (or a SLURM wrapper that sets the same variables) started this process as one rank."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def worker_device(backend: str, rank: int) -> torch.device:
    """The device a rank computes on: cuda:(rank % visible GPUs) with NCCL, the CPU with gloo."""
    if backend == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_backend(backend: str, world_size: int) -> None:
    """Raise ConfigError unless `backend` can run `world_size` ranks here."""
    if backend not in DIST_BACKENDS:
        raise ConfigError(f"exec backend must be one of {DIST_BACKENDS}, got {backend!r}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"exec world size must be an integer >= 1, got {world_size!r}.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("exec backend nccl needs CUDA GPUs and none is visible; use backend gloo on this machine.")


def launch(
    worker: Callable[..., dict], world_size: int, *, backend: str = "gloo", timeout_s: float = 300.0, **kwargs
) -> list[dict]:
    """Spawn `world_size` ranks, run worker(rank, world_size, **kwargs) in each, return their dicts in rank order.

    Raises ReproError naming the first failed rank and its error sentence when any rank raises or dies; no rank
    is left running and the call returns within about 2 x timeout_s of the failure. A SIGTERM while it runs stops
    the ranks first and is then re-delivered to the previous handler (by default the process dies of it).
    """
    check_backend(backend, world_size)
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ConfigError(
            f"exec backend nccl runs one rank per GPU: {world_size} ranks need {world_size} GPUs but "
            f"{torch.cuda.device_count()} are visible; use fewer ranks or backend gloo."
        )
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=timeout_s))
    context = mp.get_context("spawn")
    results: queue.Queue = context.Queue()
    processes = [
        context.Process(
            target=_spawned_rank,
            args=(worker, rank, world_size, backend, store.port, timeout_s, kwargs, results, os.getpid()),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    sigterms: list[int] = []  # the handler only appends: no lock a signal could interrupt
    previous_handler = _catch_sigterm(sigterms)
    guardian = _start_guardian()
    try:
        for process in processes:
            if not sigterms:
                process.start()
                _tell_guardian(guardian, f"{process.pid}\n")
        outcomes = _collect(processes, results, timeout_s, sigterms)
    finally:
        _stop_ranks(processes, TERMINATE_GRACE_S if sigterms else 0.0)
        _release_guardian(guardian)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        del store
    if sigterms:
        del processes, results  # frees the queue's semaphores now: dying of the signal skips that cleanup
        signal.raise_signal(signal.SIGTERM)  # the handler we replaced decides; by default this process ends here
        raise ReproError(f"exec driver received SIGTERM and stopped its {world_size} ranks before they finished.")
    failures = {rank: outcome for rank, outcome in outcomes.items() if outcome[0] != "ok"}
    if failures:
        raise ReproError(_failure_sentence(failures, world_size))
    return [outcomes[rank][1] for rank in range(world_size)]


PREPARE_TIMEOUT_S = 3600  # rank 0 may train a routing model before the others read its cached trace


def check_torchrun_world_size(devices: int) -> None:
    """One ConfigError sentence, before any rendezvous or collective, unless torchrun started `devices` ranks (a
    mismatch would otherwise leave the ranks waiting on each other)."""
    world_size = os.environ["WORLD_SIZE"]
    if not world_size.isdigit() or int(world_size) != devices:
        raise ConfigError(
            f"torchrun started WORLD_SIZE={world_size} ranks but the plan places experts on parallel.devices="
            f"{devices} devices; start {devices} ranks (--nproc-per-node x --nnodes) or set "
            f"parallel.devices={world_size}."
        )


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> int:
    """Initialise the default process group of a torchrun rank from its environment; returns this rank."""
    if not in_torchrun():
        raise ConfigError(f"torchrun sets {', '.join(TORCHRUN_ENV)}; without them use launch() to spawn the ranks.")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    check_backend(backend, world_size)
    _init(backend, rank, world_size, timeout_s, store=None)
    return rank


def join(worker: Callable[..., dict], *, backend: str = "gloo", timeout_s: float = 300.0, **kwargs) -> list[dict]:
    """Run this process as one rank of a torchrun job; returns every rank's dict (rank order) on every rank.

    Uses the default process group when one is initialised (init_from_env), else initialises and destroys it.
    """
    owns_group = not dist.is_initialized()
    if owns_group:
        init_from_env(backend, timeout_s)
    try:
        result = worker(dist.get_rank(), dist.get_world_size(), **kwargs)
        return _all_gather_json(result, worker_device(backend, dist.get_rank()))
    finally:
        if owns_group:
            dist.destroy_process_group()


# ---- inside a spawned rank -----------------------------------------------------------------------------------


def _init(backend: str, rank: int, world_size: int, timeout_s: float, store) -> None:
    if backend == "nccl":
        torch.cuda.set_device(worker_device(backend, rank))
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun sets it per node
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, store=store, timeout=dt.timedelta(seconds=timeout_s)
    )


def _die_with_parent(parent_pid: int) -> None:
    """Make this rank end when `parent_pid` (the driver that spawned it) ends, however the driver ends.

    Linux: the kernel sends SIGKILL when the parent dies (PR_SET_PDEATHSIG). Everywhere: exit now if the parent is
    already gone (it may die while this rank imports torch, before the prctl), and a daemon thread exits when the
    parent pid changes (re-parented to init or a subreaper).
    """
    if HAS_PDEATHSIG:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # best effort: the pid check below still guards
    if os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT_CODE)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name="exec-parent-watch", daemon=True).start()


def _spawned_rank(worker, rank, world_size, backend, port, timeout_s, kwargs, results, parent_pid) -> None:
    _die_with_parent(parent_pid)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=dt.timedelta(seconds=timeout_s))
        _init(backend, rank, world_size, timeout_s, store)
        result = worker(rank, world_size, **kwargs)
        json.dumps(result)  # a result the driver cannot serialise is this rank's error, not the driver's
        results.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the driver as one sentence
        results.put((rank, "error", _error_sentence(e), _lost_peer(e)))
        traceback.print_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# what a rank raises when another rank died or stalled: gloo reports a closed connection as a plain RuntimeError
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "timed out", "Timed out", "NCCL")


def _lost_peer(e: BaseException) -> bool:
    """True for the errors a rank gets because a peer failed (secondary), not for its own failures."""
    return isinstance(e, dist.DistError | TimeoutError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_FAILURE_MARKERS)
    )


def _error_sentence(e: BaseException) -> str:
    first_line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first_line}" if first_line else type(e).__name__


# ---- in the driver -------------------------------------------------------------------------------------------


def _catch_sigterm(sigterms: list[int]):
    """Record SIGTERMs in `sigterms` instead of dying of them, so launch can stop its ranks first; returns the
    handler to restore, or None when nothing was installed (not the main thread, SIGTERM ignored, or a handler
    installed outside Python, which we could not restore)."""
    if threading.current_thread() is not threading.main_thread():
        return None  # signal.signal works only there; PR_SET_PDEATHSIG still stops the ranks if the driver dies
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous == signal.SIG_IGN:
        return None
    signal.signal(signal.SIGTERM, lambda signum, frame: sigterms.append(signum))
    return previous


def _start_guardian() -> subprocess.Popen | None:
    """The process that SIGKILLs the ranks if this driver dies (GUARDIAN_CODE); None off Linux (no /proc)."""
    if not HAS_PDEATHSIG:
        return None
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", GUARDIAN_CODE], stdin=subprocess.PIPE, text=True)


def _tell_guardian(guardian: subprocess.Popen | None, line: str) -> None:
    if guardian is not None:
        try:
            guardian.stdin.write(line)
            guardian.stdin.flush()
        except OSError:
            pass  # a guardian killed on its own: the ranks' own guards remain


def _release_guardian(guardian: subprocess.Popen | None) -> None:
    """Tell the guardian the ranks are stopped, so it exits without killing anything, and reap it."""
    if guardian is not None:
        _tell_guardian(guardian, "done\n")
        try:
            guardian.stdin.close()
        except OSError:
            pass
        guardian.wait()


def _stop_ranks(processes, grace_s: float) -> None:
    """End every started rank still running: SIGTERM and up to grace_s to exit when grace_s > 0, then SIGKILL."""
    started = [p for p in processes if p.pid is not None]
    if grace_s > 0:
        for process in started:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process in started:
            process.join(max(0.0, deadline - time.monotonic()))
    for process in started:
        if process.is_alive():
            process.kill()
        process.join()


def _collect(processes, results, timeout_s: float, sigterms: list[int]) -> dict:
    """{rank: ("ok", dict) | ("error", sentence, is_comm_error, t) | ("died", sentence, False, t)}; returns when
    every rank reported, timeout_s after the first failure, or at once when `sigterms` is no longer empty."""
    outcomes: dict = {}
    first_failure = None
    while len(outcomes) < len(processes) and not sigterms:
        if first_failure is not None and time.monotonic() - first_failure > timeout_s:
            break
        try:
            rank, status, *rest = results.get(timeout=0.05)
            if status == "ok":
                outcomes[rank] = ("ok", rest[0])
            else:
                outcomes[rank] = ("error", rest[0], rest[1], time.monotonic())
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if rank not in outcomes and not process.is_alive():
                _drain(results, outcomes)  # a rank that exited cleanly may have reported meanwhile
                if rank not in outcomes:
                    outcomes[rank] = ("died", f"the process exited with code {process.exitcode} without a result",
                                      False, time.monotonic())
        if first_failure is None and any(o[0] != "ok" for o in outcomes.values()):
            first_failure = time.monotonic()
    for rank in range(len(processes)):
        # a rank still busy long after its peers failed is the likeliest culprit of a stall: not marked secondary
        outcomes.setdefault(rank, ("died", f"still running {timeout_s:g} s after another rank failed; stopped",
                                   False, time.monotonic()))
    return outcomes


def _drain(results, outcomes) -> None:
    while True:
        try:
            rank, status, *rest = results.get(timeout=0.2)
        except queue.Empty:
            return
        outcomes[rank] = ("ok", rest[0]) if status == "ok" else ("error", rest[0], rest[1], time.monotonic())


def _failure_sentence(failures: dict, world_size: int) -> str:
    # the root cause is a rank that died or raised on its own (earliest first); peers that lost it come after
    order = sorted(failures, key=lambda r: (failures[r][2], failures[r][3], r))
    first = order[0]
    tail = f" (ranks {order[1:]} then failed too)" if len(order) > 1 else ""
    return f"exec rank {first} of {world_size} failed: {failures[first][1]}{tail}."


def _all_gather_json(result: dict, device: torch.device) -> list[dict]:
    """Every rank's JSON-serialisable dict, exchanged as UTF-8 bytes (variable length, padded to the longest)."""
    payload = torch.tensor(list(json.dumps(result).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64, device=device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(payload)] = payload
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [json.loads(bytes(g[: int(s.item())].cpu().tolist()).decode()) for g, s in zip(gathered, sizes, strict=True)]
