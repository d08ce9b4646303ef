import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
# Triton kernels run in the CPU interpreter; it must be on before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip when this checkout has no shared folder beside it."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent (only developer machines and CI have it)")
    return SHARED_DATA
