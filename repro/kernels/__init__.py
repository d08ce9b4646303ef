"""Triton kernels for every data-path step of an expert-parallel MoE layer, each beside its torch reference.

One file per kernel, each written as a small document (pseudo-code, kernel, wrapper, reference):
`gating` (top-k routing), `dispatch` (layout, permute, unpermute), `grouped_gemm` (SwiGLU experts over
expert-sorted tokens), `shuffle` (Sem-MoE Algorithm 3 at run time).

Every public function takes `backend`: "triton", "torch" (the reference) or "auto". "auto" runs Triton where
it can run: on CUDA tensors, or on CPU when the Triton interpreter is on (`TRITON_INTERPRET=1`, which must be
set before the kernel modules are imported); otherwise it runs the torch reference.
"""

from __future__ import annotations

import os

import torch

from repro.errors import ConfigError

BACKENDS = ("auto", "triton", "torch")


def interpreter_on() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor: torch.Tensor, backend: str = "auto") -> bool:
    """Whether a kernel called on `tensor` with `backend` runs Triton (True) or the torch reference (False).

    Raises ConfigError for an unknown backend, for "triton" on a CPU tensor without the interpreter, and for
    bf16 in the interpreter (it computes bf16 wrongly: run fp32/fp16 on CPU, bf16 on a GPU).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"kernel backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "torch":
        return False
    runnable = tensor.is_cuda or interpreter_on()
    if backend == "triton" and not runnable:
        raise ConfigError(
            "the triton backend needs a CUDA tensor or TRITON_INTERPRET=1 set before repro.kernels is imported; "
            "use backend='torch' on this CPU."
        )
    if runnable and not tensor.is_cuda and tensor.dtype == torch.bfloat16:
        raise ConfigError(
            "bf16 is computed wrongly by the Triton CPU interpreter; use float32 or float16 on CPU, bf16 on a GPU."
        )
    return runnable
