"""Build the optional CUDA extension `deadpool_cuda_kernels` (fused snapshot pack + checksum).

Install with ``pip install --no-build-isolation ./cuda_kernels`` into an environment whose
torch is a CUDA build (the extension is compiled against that torch).
megatron_deadpool.replication.pack uses it for CUDA tensors when ``import deadpool_cuda_kernels``
succeeds; without it the pure-torch fallback computes the same bytes and checksum.
"""

from __future__ import annotations

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

setup(
    name="deadpool-cuda-kernels",
    version="0.1.0",
    description="Fused snapshot pack + checksum kernels for megatron-deadpool",
    ext_modules=[
        CUDAExtension(
            name="deadpool_cuda_kernels",
            sources=["binding.cpp", "pack_checksum.cu"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
