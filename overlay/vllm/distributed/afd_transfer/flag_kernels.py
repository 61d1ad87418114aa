# SPDX-License-Identifier: Apache-2.0
"""Slot transfers that wait on and raise their flag inside the copy kernel.

The stream memory operations of ``stream_flags`` put five graph nodes on
each side of a transfer (copy, raise; wait, lower, copy), and every node of
a replayed graph starts about a microsecond after the one before it. Under
MPS the peer's kernels run beside a spinning one, so one kernel can do a
whole half instead: ``copy_then_raise`` copies the rows and its last block
to finish raises the flag; ``wait_then_copy`` spins until the flag is
raised, copies, and its last block lowers it; ``wait_then_lower`` is the
receive of a side that reads the slot in place. A layer's round trip then
takes four nodes instead of nine.

Their flags live in device memory that both processes map (CUDA IPC). Seen
on an H200 under MPS: with the flags in the shared host page that the
stream operations use, a flag one process's kernel raised never reached the
other process's spinning kernel, although a host store did. So a spin also
polls a release word in that host page, which only hosts write: a process
that lost its peer, or the attention rank waiting for a replacement, stores
1 there and the spin ends as if the flag had been raised.

Without MPS a spinning kernel holds the GPU until its time slice ends, so
the ipc connector uses them only with ``ipc_signal: "kernel"``, which needs
MPS (``IpcSlots``). Under MPS too a spinning block holds its SM while the
peer computes: a peer kernel that needs a whole SM waits for the SMs the
spins leave free.

The kernels are compiled once per process and GPU architecture with NVRTC,
and launched with ``cuLaunchKernel`` on the current stream, which CUDA
graphs capture like any kernel launch.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from vllm.distributed.afd_transfer.stream_flags import check_cuda

_SOURCE = r"""
// A block's arrival count returns to 0 with its last block, so a captured
// launch replays as it was captured.
__device__ bool last_block(unsigned int* arrivals) {
    __shared__ bool last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(arrivals, 1u) == gridDim.x - 1;
        if (last) *arrivals = 0u;
    }
    __syncthreads();
    return last;
}

// Another process writes the flag: every poll reads it afresh.
__device__ unsigned int load_flag(const unsigned int* flag) {
    unsigned int value;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    return value;
}

// Until the peer raises the flag, or a host stores 1 in the release word
// (mapped host memory: a slow read, hence only every 64th poll).
__device__ void spin_until_raised(const unsigned int* flag, const unsigned int* release) {
    if (threadIdx.x == 0) {
        for (unsigned int polls = 1; load_flag(flag) != 1u; ++polls) {
            if (polls % 64u == 0u && load_flag(release) != 0u) break;
        }
    }
    __syncthreads();
}

// The peer wrote src: __ldcv never reads a stale L1 line. 16-byte pieces
// where both ends allow them (a slow copy holds the peer up), then words.
__device__ void copy_words(const unsigned int* src, unsigned int* dst, long long words) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long pieces = 0;
    if ((((unsigned long long)src | (unsigned long long)dst) & 15ull) == 0ull) {
        pieces = words / 4;
        const uint4* src4 = (const uint4*)src;
        uint4* dst4 = (uint4*)dst;
        for (long long i = first; i < pieces; i += stride) dst4[i] = __ldcv(src4 + i);
    }
    for (long long i = 4 * pieces + first; i < words; i += stride) dst[i] = __ldcv(src + i);
}

extern "C" __global__ void copy_then_raise(const unsigned int* src, unsigned int* dst,
                                           long long words, unsigned int* flag,
                                           unsigned int* arrivals) {
    copy_words(src, dst, words);
    if (last_block(arrivals) && threadIdx.x == 0) {
        *(volatile unsigned int*)flag = 1u;
        __threadfence_system();
    }
}

extern "C" __global__ void wait_then_copy(const unsigned int* src, unsigned int* dst,
                                          long long words, unsigned int* flag,
                                          unsigned int* arrivals, const unsigned int* release) {
    spin_until_raised(flag, release);
    copy_words(src, dst, words);
    // Every block has passed its spin before the last one lowers the flag.
    if (last_block(arrivals) && threadIdx.x == 0) {
        *(volatile unsigned int*)flag = 0u;
        __threadfence_system();
    }
}

extern "C" __global__ void wait_then_lower(unsigned int* flag, const unsigned int* release) {
    spin_until_raised(flag, release);
    if (threadIdx.x == 0) {
        *(volatile unsigned int*)flag = 0u;
        __threadfence_system();
    }
}
"""

_THREADS = 256
_MAX_SPINNING_BLOCKS = 16
"""Blocks of a ``wait_then_copy``: while its blocks spin they hold their
SMs, and the peer kernels that will raise the flag need SMs to run on. A
GEMM that takes a whole SM's registers fits on none that a spinning block
holds, so the spin keeps to a few SMs and leaves the others free."""


def _compile(arch: str) -> bytes:
    from cuda.bindings import nvrtc

    def check(result: tuple, what: str):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what} failed: {result[0]}")
        return result[1] if len(result) > 1 else None

    program = check(
        nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"afd_flag_kernels.cu", 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        (result,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
            raise RuntimeError(f"compiling the AFD flag kernels failed:\n{log.decode()}")
        size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


class FlagKernels:
    """The three kernels, loaded into one GPU's primary context (one
    instance per process and GPU: ``flag_kernels``). A copy takes the
    address of an int32 arrival counter, 0 between launches, that no launch
    on another stream uses at the same time; a wait takes the address of
    its release word."""

    def __init__(self, device_index: int) -> None:
        from cuda.bindings import driver

        self._driver = driver
        major, minor = torch.cuda.get_device_capability(device_index)
        with torch.cuda.device(device_index):
            torch.zeros(1, device="cuda")  # the primary context, current in this thread
            self._image = ctypes.create_string_buffer(_compile(f"sm_{major}{minor}"))
            self._module = check_cuda(
                driver.cuModuleLoadData(ctypes.addressof(self._image)), "cuModuleLoadData"
            )
            self._functions = {
                name: check_cuda(
                    driver.cuModuleGetFunction(self._module, name.encode()), "cuModuleGetFunction"
                )  # fmt: skip
                for name in ("copy_then_raise", "wait_then_copy", "wait_then_lower")
            }
        self._blocks = torch.cuda.get_device_properties(device_index).multi_processor_count

    def _launch(self, name: str, blocks: int, args: tuple) -> None:
        driver = self._driver
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        types = tuple(ctypes.c_longlong if arg == "words" else ctypes.c_void_p for arg in args)
        check_cuda(
            driver.cuLaunchKernel(self._functions[name], blocks, 1, 1, _THREADS, 1, 1, 0,
                                  stream, (tuple(args.values()), types), 0),
            name,
        )  # fmt: skip

    def _copy(
        self, name: str, src: torch.Tensor, dst: torch.Tensor, max_blocks: int, **addresses: int
    ) -> None:
        assert src.is_contiguous() and dst.is_contiguous() and src.nbytes == dst.nbytes
        assert src.nbytes % 4 == 0 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0
        words = src.nbytes // 4
        blocks = max(1, min(max_blocks, -(-words // (4 * _THREADS))))  # a piece is 4 words
        args = {"src": src.data_ptr(), "dst": dst.data_ptr(), "words": words, **addresses}
        self._launch(name, blocks, args)

    def copy_then_raise(self, src: torch.Tensor, dst: torch.Tensor, flag: int, arrivals: int):
        """Copy ``src`` into ``dst``, then raise the flag at address ``flag``."""
        self._copy("copy_then_raise", src, dst, self._blocks, flag=flag, arrivals=arrivals)

    def wait_then_copy(
        self, src: torch.Tensor, dst: torch.Tensor, flag: int, arrivals: int, release: int
    ) -> None:
        """Wait until the flag is raised (or released), copy ``src`` into
        ``dst``, lower the flag."""
        self._copy("wait_then_copy", src, dst, _MAX_SPINNING_BLOCKS,
                   flag=flag, arrivals=arrivals, release=release)  # fmt: skip

    def wait_then_lower(self, flag: int, release: int) -> None:
        """Wait until the flag is raised (or released), then lower it."""
        self._launch("wait_then_lower", 1, {"flag": flag, "release": release})


@functools.cache
def flag_kernels(device_index: int) -> FlagKernels:
    """The kernels for visible GPU ``device_index``, compiled on first use."""
    return FlagKernels(device_index)
