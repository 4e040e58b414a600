"""Build the optional CUDA extension `deadpool_cuda_kernels` (fused snapshot pack + checksum)
at install time.

Install with ``pip install --no-build-isolation ./cuda_kernels`` from a checkout, into an
environment whose torch is a CUDA build (the extension is compiled against that torch). The
sources live in the package (``megatron_deadpool/replication/kernels/``), which also builds
them on first use on a GPU when this extension is not installed
(``megatron_deadpool.replication.kernel_build``); this build is the install-time option.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

KERNELS = Path(__file__).resolve().parent.parent / "megatron_deadpool" / "replication" / "kernels"
if not (KERNELS / "pack_checksum.cu").exists():
    raise SystemExit(
        f"kernel sources not found in {KERNELS}: run pip install --no-build-isolation "
        "./cuda_kernels from a checkout of megatron-deadpool"
    )

setup(
    name="deadpool-cuda-kernels",
    version="0.2.0",
    description="Fused snapshot pack + checksum kernels for megatron-deadpool",
    ext_modules=[
        CUDAExtension(
            name="deadpool_cuda_kernels",
            sources=[str(KERNELS / "binding.cpp"), str(KERNELS / "pack_checksum.cu")],
            include_dirs=[str(KERNELS)],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
