"""CUDA plumbing (floor 1): NVRTC builds and their cache (``jit``), the driver API (``driver``), the
kernel launchers (``kernels``, ``kernel_params``) and the NVSHMEM build (``nvshmem_build``).

It builds on the core at the package root and on nothing above it.
"""
