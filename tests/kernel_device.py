"""Where the Triton kernel tests run, so that the same test functions run interpreted on a CPU and compiled on
a CUDA device (tests/conftest.py decides TRITON_INTERPRET first).

KERNEL_DEVICE: cpu when the interpreter is on, cuda when it is off and a CUDA device exists, None otherwise
(TRITON_INTERPRET=0 on a CPU machine: Triton cannot run, so tests that call a kernel skip saying so).
`on_kernel_device(fn)` wraps a kernel entry point: tensor (and, on CUDA, numpy array) arguments go to
KERNEL_DEVICE, tensor outputs come back to the CPU, so a test compares them with CPU references unchanged.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from repro.kernels import interpreter_on

if interpreter_on():
    KERNEL_DEVICE: torch.device | None = torch.device("cpu")
elif torch.cuda.is_available():
    KERNEL_DEVICE = torch.device("cuda")
else:
    KERNEL_DEVICE = None
COMPILED = KERNEL_DEVICE is not None and KERNEL_DEVICE.type == "cuda"
NO_KERNELS = ("Triton kernels need a CUDA device or TRITON_INTERPRET=1 and this machine has neither (TRITON_INTERPRET=0 "
              "on a CPU); unset TRITON_INTERPRET to let tests/conftest.py turn the interpreter on")

interpreter_only = pytest.mark.skipif(
    not interpreter_on(), reason="checks the Triton CPU interpreter's own behaviour (TRITON_INTERPRET=1 only)"
)
compiled_only = pytest.mark.skipif(
    not COMPILED, reason="bf16 / compiled-mode check: needs a CUDA device with TRITON_INTERPRET unset (the CPU "
    "interpreter computes bf16 wrongly); run `make gpu-test` on a GPU machine"
)


def to_device(value, device: torch.device):
    """value with its tensors (and, off the CPU, numpy arrays) moved to device; tuples and lists kept."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, np.ndarray) and device.type != "cpu":
        return torch.from_numpy(np.ascontiguousarray(value)).to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(to_device(v, device) for v in value)
    return value


def on_kernel_device(fn):
    """fn run on KERNEL_DEVICE (see the module docstring); skips the test when no Triton can run here."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if KERNEL_DEVICE is None:
            pytest.skip(NO_KERNELS)
        out = fn(*to_device(args, KERNEL_DEVICE), **{k: to_device(v, KERNEL_DEVICE) for k, v in kwargs.items()})
        return to_device(out, torch.device("cpu"))

    return run
