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
