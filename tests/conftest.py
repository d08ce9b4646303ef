import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
# Triton kernels: compiled on a machine with a CUDA device (the kernel tests then run there, see
# tests/kernel_device.py), in the CPU interpreter otherwise. It must be decided before anything imports triton.
# An explicit TRITON_INTERPRET wins: =1 forces the interpreter, =0 on a CPU machine makes the kernel tests skip
# (Triton cannot run there at all) while the references still run.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip when this checkout has no shared folder beside it."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent (only developer machines and CI have it)")
    return SHARED_DATA


def pid_written_to(path: Path, timeout_s: float) -> int:
    """The process id a child writes to `path`, once it has (the kill tests wait for their stand-in to start)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


def assert_ends(pid: int, timeout_s: float, why: str) -> None:
    """Assert that process `pid` ends within timeout_s; SIGKILL it first when it does not, so no test leaves it."""
    import signal

    from repro.proctree import wait_ended

    stopped = wait_ended([pid], timeout_s)
    if not stopped:
        os.kill(pid, signal.SIGKILL)
    assert stopped, why
