"""No process of repro.exec outlives its driver: SIGKILL or SIGTERM the driver of 2 gloo ranks (one sleeping, one
blocked in a collective, or both still starting) and every process it started (the ranks, the multiprocessing
resource tracker, the guardian) is gone within a few seconds; a rank whose driver died before it was guarded, or
where PR_SET_PDEATHSIG is unavailable, exits on its own. Linux only: liveness and parentage come from /proc.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repro.exec.launch import PARENT_POLL_S
from repro.proctree import running as alive

TESTS = Path(__file__).resolve().parent
GONE_WITHIN_S = 5.0  # PR_SET_PDEATHSIG and the SIGTERM path end the ranks in ~0.2 s; this leaves room for load
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


def _stat(pid: int) -> list[str] | None:
    """Fields after the command name in /proc/PID/stat (state, ppid, ...), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None




def children(ppid: int) -> dict[int, str]:
    """{pid: command line} of the live processes whose parent is ppid."""
    found = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields and int(fields[1]) == ppid and fields[0] not in ("Z", "X"):
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return found


def wait_gone(pids, within_s: float) -> list[int]:
    """The pids still alive after within_s (empty as soon as all are gone); kills those so no test leaks them."""
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def python(code: str, **kwargs) -> subprocess.Popen:
    """`python -c "import exec_kill_helper as h; CODE"` with tests/ on sys.path (spawned ranks inherit it)."""
    prefix = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import exec_kill_helper as h; "
    return subprocess.Popen([sys.executable, "-c", prefix + code], **kwargs)


def start_driver(tmp_path: Path, mode: str, ready: str = "rank*.pid") -> tuple[subprocess.Popen, dict[int, str]]:
    """A driver of 2 blocking ranks; returns it with its children once 2 files `ready` exist (both ranks run)."""
    driver = python(f"h.drive({str(tmp_path)!r}, {mode!r})", stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60  # three interpreters import torch: ~5 s idle, far more on a busy machine
    while len(list(tmp_path.glob(ready))) < 2:
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            pytest.fail(f"the driver's ranks did not start: {driver.communicate()[1].decode()[-2000:]}")
        time.sleep(0.05)
    return driver, children(driver.pid)


def rank_pids(started: dict[int, str]) -> list[int]:
    return [pid for pid, cmd in started.items() if "multiprocessing.spawn" in cmd]


@pytest.mark.parametrize(
    "sig, mode, returncode",
    [
        (signal.SIGKILL, "default", -signal.SIGKILL),
        (signal.SIGTERM, "default", -signal.SIGTERM),  # launch stops its ranks, then dies of the SIGTERM it got
        (signal.SIGTERM, "own_handler", 7),  # the driver's own SIGTERM handler still runs, after the ranks stopped
    ],
)
def test_killing_the_driver_leaves_no_process_behind(tmp_path, sig, mode, returncode):
    driver, started = start_driver(tmp_path, mode)
    ranks = [int(f.read_text()) for f in tmp_path.glob("rank*.pid")]
    trackers = [pid for pid, cmd in started.items() if "resource_tracker" in cmd]
    assert sorted(ranks) == rank_pids(started) and len(trackers) == 1, started  # so the check below covers all
    driver.send_signal(sig)
    _, stderr = driver.communicate(timeout=15)
    assert driver.returncode == returncode, stderr.decode()[-2000:]
    assert wait_gone(started, GONE_WITHIN_S) == [], f"still alive {GONE_WITHIN_S} s after the driver: {started}"
    # SIGTERM: the ranks got SIGTERM first (rank 0 recorded it; rank 1, stuck in gloo, took SIGKILL after the grace)
    assert (tmp_path / "rank0.sigterm").exists() == (sig == signal.SIGTERM)
    if sig == signal.SIGTERM:
        assert b"leaked semaphore" not in stderr, stderr.decode()[-2000:]  # the driver freed its queue first


def test_sigkill_while_the_ranks_still_import_leaves_no_process_behind(tmp_path):
    # the ranks sleep inside the unpickling of their task, before launch's code runs in them (the seconds a real
    # rank spends importing torch): neither PR_SET_PDEATHSIG nor the parent-pid watch exists yet, the guardian must
    driver, started = start_driver(tmp_path, "slow_rank_import", ready="importing*")
    assert len(rank_pids(started)) == 2, started
    driver.kill()
    driver.communicate(timeout=15)
    assert wait_gone(started, GONE_WITHIN_S) == [], f"still alive {GONE_WITHIN_S} s after the driver: {started}"


def test_a_rank_whose_driver_died_before_it_was_guarded_exits():
    # the middle process exits while its child still imports torch, so PR_SET_PDEATHSIG would come too late: the
    # parent-pid check at the guard must stop the child before it prints its own pid into our pipe
    middle = python(f"h.spawn_orphan(True, {PARENT_POLL_S}, wait_for_guard=False)", stdout=subprocess.PIPE, text=True)
    try:
        out, _ = middle.communicate(timeout=60)  # EOF only once the child, which shares the pipe, has exited
    except subprocess.TimeoutExpired:
        middle.kill()
        pytest.fail("the orphan got past its guard and kept running")
    pids = out.split()
    assert len(pids) == 1, f"the orphan got past its guard and printed its pid: {pids}"
    assert wait_gone([int(pids[0])], GONE_WITHIN_S) == []


@pytest.mark.parametrize(
    "use_pdeathsig, poll_s",
    [
        (True, 3600.0),  # PR_SET_PDEATHSIG alone: the watch thread would wake only in an hour
        (False, PARENT_POLL_S),  # as off Linux: the parent-pid watch thread alone
    ],
)
def test_each_guard_alone_stops_a_rank_whose_parent_dies(use_pdeathsig, poll_s):
    middle = python(f"h.spawn_orphan({use_pdeathsig}, {poll_s}, wait_for_guard=True)", stdout=subprocess.PIPE,
                    text=True)
    out, _ = middle.communicate(timeout=60)  # the middle prints the child's pid once the child is guarded, and exits
    assert wait_gone([int(out)], GONE_WITHIN_S) == []
