"""repro.side_by_side, make reproduce's two streams: both run, a failure stops the other stream's whole process
group at once, and the exit status is the first failure's."""

import time
from pathlib import Path

from conftest import assert_ends, pid_written_to

from repro.proctree import running as alive
from repro.side_by_side import run


def test_both_streams_run_with_one_thread_each(tmp_path):
    log = tmp_path / "logs" / "background.log"
    status = run("echo background $OMP_NUM_THREADS", f"echo foreground $OMP_NUM_THREADS > {tmp_path / 'fg'}", log)
    assert status == 0
    assert log.read_text() == "background 1\n" and (tmp_path / "fg").read_text() == "foreground 1\n"


def test_a_failing_stream_stops_the_other_ones_process_group(tmp_path, capsys):
    pid_file = tmp_path / "grandchild"
    # the background stream's grandchild would run for a minute: it must be gone when run() returns
    background = f"sleep 60 & echo $! > {pid_file}; wait"
    started = time.perf_counter()
    status = run(background, f"while [ ! -s {pid_file} ]; do sleep 0.05; done; exit 3", tmp_path / "bg.log")
    assert status == 3 and time.perf_counter() - started < 20
    grandchild, deadline = int(pid_file.read_text()), time.perf_counter() + 10
    while alive(grandchild) and time.perf_counter() < deadline:  # SIGTERM was sent; dying takes a moment
        time.sleep(0.05)
    assert not alive(grandchild)
    assert "failed" not in capsys.readouterr().err  # the background stream did not fail: it was stopped


def test_a_failing_background_stream_shows_its_log(tmp_path, capsys):
    status = run("echo the cause; exit 5", "sleep 60", tmp_path / "bg.log")
    assert status == 5
    err = capsys.readouterr().err
    assert "the cause" in err and f"its output: {tmp_path / 'bg.log'}" in err


def test_an_orphaned_guard_ends_a_stream_child_that_ignores_sigterm(tmp_path):
    """Item 6: when side_by_side dies by SIGKILL, its guard stops the stream's group; a child of the stream that
    ignores SIGTERM outlived the stream's shell under init. The guard now SIGKILLs what is left after its grace."""
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "straggler.pid"
    command = f"sh -c 'trap \"\" TERM; echo $$ > {pid_file}; exec sleep 60' & wait"
    parent = subprocess.Popen([sys.executable, "-c", (  # stands in for side_by_side: starts the guard, then sleeps
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-m', 'repro.side_by_side', '--guard', str(os.getpid()), '--command', "
        f"{command!r}, '--grace', '0.5'], start_new_session=True)\n"
        "time.sleep(60)\n")], cwd=Path(__file__).resolve().parents[1])
    straggler = pid_written_to(pid_file, 20)
    time.sleep(0.2)  # the trap is set before the pid is written; exec sleep keeps it
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert_ends(straggler, 8, "a stream child that ignores SIGTERM outlived side_by_side and its guard")
