// transport.cuh: how a kernel writes into another rank's symmetric allocation.
//
// Every remote write of the kernels goes through the helpers below, so the two transports differ
// only here:
//   PUT_TRANSPORT 0 (vmm, nccl symmetric, nvshmem p2p): s_peer[r] is rank r's allocation mapped
//     into this process; writes are plain stores over NVLink, flags are release stores.
//   PUT_TRANSPORT 1 (nvshmem put): s_peer[r] is THIS rank's address of the symmetric allocation
//     (the same for every r: NVSHMEM addresses a peer's copy by the local address plus the PE).
//     Words and flags go as NVSHMEM value puts, rows as warp-wide NVSHMEM puts from a copy in this
//     rank's own allocation (NVSHMEM may move only symmetric or registered memory to other nodes),
//     and every thread completes its puts (nvshmem_quiet) before its block counts itself done.
//
// Built with PUT_TRANSPORT 1 only by moe_comm's nvshmem backend, which hands NVRTC the NVSHMEM and
// CCCL include directories and initialises the module's NVSHMEM state after loading it.
#pragma once

#ifndef PUT_TRANSPORT
#define PUT_TRANSPORT 0
#endif

#if PUT_TRANSPORT
// NVSHMEM's device API, header-only (every device function inlined), as NVRTC can compile it:
// without the IB/GPUNetIO device paths (their headers need a full CUDA toolchain) and with the
// std:: type traits the headers name taken from CCCL (NVRTC has no standard library).
#define __NVSHMEM_NUMBA_SUPPORT__ 1
#include <non_abi/nvshmem_build_options.h>
#undef NVSHMEM_IBGDA_SUPPORT
#undef NVSHMEM_IBGDA_SUPPORT_GPUMEM_ONLY
#undef NVSHMEM_GPUNETIO_SUPPORT
#include <cuda/std/type_traits>
namespace std {
using cuda::std::enable_if;
using cuda::std::is_floating_point;
using cuda::std::is_integral;
using cuda::std::is_same;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
using cuda::std::remove_cv;
}  // namespace std
#include <device/nvshmem_defines.h>
#include <device/nvshmemx_defines.h>
#endif
