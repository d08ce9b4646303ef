"""Helpers for tests/test_exec_kill.py, importable by spawned ranks (the test puts tests/ on sys.path).

drive(PID_DIR, MODE): an exec driver that launches 2 gloo ranks which record their pids in PID_DIR, then block
until killed: rank 0 sleeps in Python and on SIGTERM writes PID_DIR/rank0.sigterm and exits; rank 1 waits inside
a gloo collective, where no Python handler runs, so only SIGKILL ends it. MODE "own_handler" installs a SIGTERM handler that
exits with OWN_HANDLER_EXIT before launching. MODE "slow_rank_import" makes each rank, while it still unpickles
its task (before any code of launch runs in it), write PID_DIR/importing{pid} and sleep: the window in which only
the driver's guardian can stop it.
spawn_orphan(...): start a child guarded by _die_with_parent(this pid), print its pid, and exit.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

OWN_HANDLER_EXIT = 7
TESTS = str(Path(__file__).resolve().parent)
SLOW_IMPORT_ENV = "EXEC_KILL_SLOW_IMPORT_DIR"

if multiprocessing.current_process().name != "MainProcess" and os.environ.get(SLOW_IMPORT_ENV):  # a spawned rank
    Path(os.environ[SLOW_IMPORT_ENV], f"importing{os.getpid()}").touch()
    time.sleep(60)


def blocking_rank(rank: int, world_size: int, pid_dir: str) -> dict:
    """Write this rank's pid to PID_DIR/rank{rank}.pid (atomically), then block for a long time."""
    import torch.distributed as dist

    if rank == 0:
        signal.signal(signal.SIGTERM, lambda signum, frame: (Path(pid_dir, "rank0.sigterm").touch(), os._exit(0)))
    tmp = Path(pid_dir, f"rank{rank}.tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(Path(pid_dir, f"rank{rank}.pid"))
    if rank == 0:
        time.sleep(120)
    dist.barrier()  # rank 1 waits here, inside gloo, for rank 0
    return {}


def drive(pid_dir: str, mode: str) -> None:
    from repro.exec.launch import launch

    if mode == "own_handler":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(OWN_HANDLER_EXIT))
    if mode == "slow_rank_import":
        os.environ[SLOW_IMPORT_ENV] = pid_dir
    launch(blocking_rank, 2, backend="gloo", timeout_s=120, pid_dir=pid_dir)


def run_orphan(parent_pid: int, use_pdeathsig: bool, poll_s: float) -> None:
    """Guard this process with _die_with_parent(parent_pid) (PR_SET_PDEATHSIG on or off, the parent-pid watch
    polling every poll_s), print its pid, then sleep (unless stopped)."""
    from repro.exec import launch

    launch.HAS_PDEATHSIG, launch.PARENT_POLL_S = use_pdeathsig, poll_s
    launch._die_with_parent(parent_pid)
    print(os.getpid(), flush=True)
    time.sleep(60)


def spawn_orphan(use_pdeathsig: bool, poll_s: float, wait_for_guard: bool) -> None:
    """Start run_orphan(this pid) in a child, print the child's pid and exit: at once (the child is still importing
    torch, not yet guarded; its stdout is ours) or once the child printed that it is guarded."""
    code = (f"import sys; sys.path.insert(0, {TESTS!r}); import exec_kill_helper as h; "
            f"h.run_orphan({os.getpid()}, {use_pdeathsig}, {poll_s})")
    piped = subprocess.PIPE if wait_for_guard else None
    child = subprocess.Popen([sys.executable, "-c", code], stdout=piped,
                             stderr=subprocess.DEVNULL if wait_for_guard else None)
    if wait_for_guard:
        child.stdout.readline()
    print(child.pid, flush=True)
    os._exit(0)
