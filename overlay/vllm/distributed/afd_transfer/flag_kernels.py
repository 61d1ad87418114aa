# SPDX-License-Identifier: Apache-2.0
"""Slot transfers that raise their flag inside the copy kernel, and waits
that spin in a kernel of one block.

The stream memory operations of ``stream_flags`` put five graph nodes on
each side of a transfer (copy, raise; wait, lower, copy), and every node of
a replayed graph starts about a microsecond after the one before it, and a
stream wait on the host page reacts slowly. Under MPS the peer's kernels
run beside a spinning one, so a transfer's send is one kernel,
``copy_then_raise`` (its last block to finish raises the flag), and its
receive one ``wait_then_lower`` (one block that spins until the flag is
raised, then lowers it) before the receiver reads the slot or copies it
out. A layer's round trip then takes five nodes instead of nine.

The spin is one block, which polls with plain loads and a pause between
them: it holds as little of the GPU as it can while the peer computes. Seen
on an H200 at Qwen3-30B-A3B's shape, a receive that spun in every block of
its copy, polling with an acquire load, made each layer's compute about
30 us slower.

Their flags live in device memory that both processes map (CUDA IPC). Seen
on an H200 under MPS: with the flags in the shared host page that the
stream operations use, a flag one process's kernel raised never reached the
other process's spinning kernel, although a host store did. So a spin also
polls a release word in that host page, which only hosts write: a process
that lost its peer for good stores a non-zero word there, and the spin ends
as if the flag had been raised.

Without MPS a spinning kernel holds the GPU until its time slice ends, so
the ipc connector uses them only under MPS (``ipc_signal``).

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

// Until the peer raises the flag to `expected` (compared as the stream
// waits compare: (int)(flag - expected) >= 0), or a host stores a non-zero
// release word (mapped host memory: a slow read, hence only every 64th
// poll). Plain volatile loads with a pause between them, then one acquire
// fence: the spin stays out of the way of the peer's kernels beside it.
// Returns, in every thread, whether the flag was raised (not released).
__device__ bool spin_until_raised(const volatile unsigned int* flag,
                                  const volatile unsigned int* release,
                                  unsigned int expected) {
    __shared__ bool raised;
    if (threadIdx.x == 0) {
        raised = true;
        for (unsigned int polls = 1; (int)(*flag - expected) < 0; ++polls) {
            __nanosleep(64);
            if (polls % 64u == 0u && *release != 0u) {
                raised = false;
                break;
            }
        }
        asm volatile("fence.acq_rel.sys;" ::: "memory");
    }
    __syncthreads();
    return raised;
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
                                           unsigned int* arrivals, unsigned int value) {
    copy_words(src, dst, words);
    if (last_block(arrivals) && threadIdx.x == 0) {
        *(volatile unsigned int*)flag = value;
        __threadfence_system();
    }
}

extern "C" __global__ void wait_then_lower(unsigned int* flag, const unsigned int* release,
                                           unsigned int expected, unsigned int lowered) {
    // A released wait leaves the flag as it is: "taken" must mean the rows
    // were there (resume.position_from_flags), even for a lost process's
    // last spin, which the attention rank releases (FFN rank lost in place).
    if (spin_until_raised(flag, release, expected) && threadIdx.x == 0) {
        *(volatile unsigned int*)flag = lowered;
        __threadfence_system();
    }
}
"""

_THREADS = 256
_ARG_TYPES = {
    "words": ctypes.c_longlong,
    "value": ctypes.c_uint,
    "expected": ctypes.c_uint,
    "lowered": ctypes.c_uint,
}
"""The kernels' arguments that are not pointers."""


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
    """The two kernels, loaded into one GPU's primary context (one
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
                for name in ("copy_then_raise", "wait_then_lower")
            }
        self._blocks = torch.cuda.get_device_properties(device_index).multi_processor_count

    def _launch(self, name: str, blocks: int, args: dict) -> None:
        driver = self._driver
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        types = tuple(_ARG_TYPES.get(arg, ctypes.c_void_p) for arg in args)
        check_cuda(
            driver.cuLaunchKernel(self._functions[name], blocks, 1, 1, _THREADS, 1, 1, 0,
                                  stream, (tuple(args.values()), types), 0),
            name,
        )  # fmt: skip

    def copy_then_raise(
        self, src: torch.Tensor, dst: torch.Tensor, flag: int, arrivals: int, value: int = 1
    ) -> None:
        """Copy ``src`` into ``dst``, then set the flag at address ``flag`` to ``value``."""
        assert src.is_contiguous() and dst.is_contiguous() and src.nbytes == dst.nbytes
        assert src.nbytes % 4 == 0 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0
        words = src.nbytes // 4
        blocks = max(1, min(self._blocks, -(-words // (4 * _THREADS))))  # a piece is 4 words
        args = {"src": src.data_ptr(), "dst": dst.data_ptr(), "words": words,
                "flag": flag, "arrivals": arrivals, "value": value}  # fmt: skip
        self._launch("copy_then_raise", blocks, args)

    def wait_then_lower(self, flag: int, release: int, expected: int = 1, lowered: int = 0) -> None:
        """Wait until the flag reaches ``expected`` (or is released), then
        set it to ``lowered``."""
        args = {"flag": flag, "release": release, "expected": expected, "lowered": lowered}
        self._launch("wait_then_lower", 1, args)


@functools.cache
def flag_kernels(device_index: int) -> FlagKernels:
    """The kernels for visible GPU ``device_index``, compiled on first use."""
    return FlagKernels(device_index)
