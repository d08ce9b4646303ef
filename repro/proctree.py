"""Process trees that end together (issue 35 item 6): the helpers every launcher of long-lived children uses
(`python -m repro.side_by_side`, `bench_serving serve`, bench/engine_cpu.py), so that killing any process of a tree
ends every process under it.

    child = subprocess.Popen(argv, start_new_session=True, preexec_fn=functools.partial(die_with, os.getpid()))
    ...
    stop_group(child)  # SIGTERM to the child's whole process group, SIGKILL to what is left after the grace

- The launcher dies, even by SIGKILL: the kernel sends the child SIGTERM (die_with: PR_SET_PDEATHSIG), and the
  child ends its own tree as it ends on SIGTERM.
- The child dies, even by SIGKILL: its own children stay in its process group (start_new_session), which the
  launcher stops as a whole (stop_group signals the group even when its leader is gone: a SIGKILLed leader once left
  its children running under init).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.05  # how often a stopping group is checked (only latency)


def die_with(parent: int) -> None:
    """preexec_fn of a child: the kernel sends it SIGTERM when `parent` (the launcher) dies, even by SIGKILL, so it
    never outlives the launcher as an orphan under init (Linux; elsewhere nothing)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a child starts able to take the stop signals
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (a zombie counts: reap the leader first)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: still there
        return True
    return True


def running(pid: int) -> bool:
    """Whether process `pid` still runs; a zombie (ended, not yet reaped by whoever adopted it) has ended. Linux
    reads /proc; elsewhere a signal 0 decides (a zombie then counts as running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return False
    except (OSError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_ended(pids, timeout_s: float) -> bool:
    """Wait up to timeout_s for every process of `pids` to end (`running`); True when they all did."""
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def others_in_group(pgid: int) -> bool:
    """Whether a running process other than this one is in group `pgid` (Linux /proc; elsewhere False: the caller
    then relies on its own child's end). Zombies are not counted: they have ended, and init reaps them."""
    me = os.getpid()
    try:
        entries = [e for e in os.scandir("/proc") if e.name.isdigit() and int(e.name) != me]
    except OSError:
        return False
    for entry in entries:
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            return True
    return False


def stop_group(process: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    """SIGTERM the process group `process` leads (start_new_session=True), SIGKILL what is left of it after grace_s
    seconds; the group is signalled even when its leader has exited already. Returns the leader's exit status."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:  # nobody left in the group
        return process.poll()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        process.poll()  # reap the leader: a zombie would still count as a member of the group
        if not group_alive(process.pid):
            return process.returncode
        time.sleep(POLL_S)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return process.wait()
