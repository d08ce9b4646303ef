"""Run two shell command lines side by side, as `make reproduce` runs its two streams (one core each):

    python -m repro.side_by_side --log runs/reproduce_b.log --background 'make experiments EXPERIMENTS=default' \
        --foreground 'make experiments EXPERIMENTS="serve_dp serve_tp"'

The foreground command writes to this terminal, the background one to --log (its last lines are printed if it
fails). Both run with OMP_NUM_THREADS=1, each in a process group of its own. When either fails, or on Ctrl-C or
SIGTERM, the other one's whole process group is stopped at once with SIGTERM (every job writes its results
atomically, so a stopped stream leaves finished jobs and no half-written one; a rerun resumes). Exit status: 0 when
both succeeded, else the first failure's (130 after Ctrl-C).

Why not a shell `&`: a background list of a non-interactive shell ignores SIGINT, and nothing stops its children
when the other stream fails, so a failed or interrupted `make reproduce` would keep running the other stream.

Each stream runs under a guard (`--guard PID`, this module again, leading the stream's process group): when this
process dies without stopping them (SIGKILL of its process group, e.g. `kill -9 -- -PGID` of `make`), the guard
sees its parent gone and stops its stream's group the same way (SIGTERM, then SIGKILL after the grace to any member
still running, a child that ignores SIGTERM included), so no stream runs on as an orphan (repro.proctree).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from repro import cli
from repro.proctree import others_in_group, stop_group

POLL_S = 0.2  # how often the two streams are checked (only latency: no result depends on it)
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL if a stream's process group is still there after this long
TAIL_LINES = 40


def stop(process: subprocess.Popen) -> None:
    """Stop a stream's whole process group (repro.proctree.stop_group: even when its leader, the guard, is gone)."""
    stop_group(process, STOP_GRACE_S)


def guard(parent: int, command: str, grace_s: float = STOP_GRACE_S) -> int:
    """Run `command` (a shell line) in this process group; stop the group when `parent` is gone (reparented): SIGTERM,
    then SIGKILL after grace_s to whatever of the group still runs, the stream's own children included (the shell
    ending first once left a child that ignored SIGTERM running under init)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the stream: wait for it, then exit
    child = subprocess.Popen(command, shell=True, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    while child.poll() is None:
        if os.getppid() != parent:  # side_by_side died without stopping us
            os.killpg(0, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and (child.poll() is None or others_in_group(os.getpgrp())):
                time.sleep(POLL_S)
            if child.poll() is None or others_in_group(os.getpgrp()):
                os.killpg(0, signal.SIGKILL)  # this guard too: nobody waits for its status any more
            break
        time.sleep(POLL_S)
    return _exit_status(child.wait())


def _guarded(command: str) -> list[str]:
    return [sys.executable, "-m", "repro.side_by_side", "--guard", str(os.getpid()), "--command", command]


def _exit_status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode  # killed by signal N: 128 + N, as a shell says


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(background: str, foreground: str, log: Path) -> int:
    """Exit status of the pair (see the module docstring)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    failed, status = None, 0
    with open(log, "w") as out:
        streams = {
            "background": subprocess.Popen(_guarded(background), stdout=out, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True),
            "foreground": subprocess.Popen(_guarded(foreground), env=env, start_new_session=True),
        }
        try:
            while failed is None and any(p.poll() is None for p in streams.values()):
                time.sleep(POLL_S)
                failed = next((name for name, p in streams.items() if p.poll()), None)  # a nonzero status
            if failed is not None:
                status = _exit_status(streams[failed].returncode)
        except KeyboardInterrupt:
            status = 130
        finally:
            for process in streams.values():
                stop(process)
            signal.signal(signal.SIGTERM, previous)
    if failed == "background":
        print("\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:]), file=sys.stderr)
        print(f"the background stream ({background}) failed; its output: {log}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--background", help="shell command line run with its output in --log")
    parser.add_argument("--foreground", help="shell command line run with its output here")
    parser.add_argument("--log", type=Path, help="file the background command's output goes to")
    # internal: a stream's guard (module docstring)
    parser.add_argument("--guard", type=cli.positive, help=argparse.SUPPRESS)
    parser.add_argument("--command", help=argparse.SUPPRESS)
    parser.add_argument("--grace", type=cli.rate, default=STOP_GRACE_S, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.guard is not None:
        return guard(args.guard, args.command, args.grace)
    if not (args.background and args.foreground and args.log):
        parser.error("--background, --foreground and --log are required")
    print(f"running `{args.background}` beside `{args.foreground}`; its output: {args.log}", flush=True)
    return run(args.background, args.foreground, args.log)


if __name__ == "__main__":
    sys.exit(main())
