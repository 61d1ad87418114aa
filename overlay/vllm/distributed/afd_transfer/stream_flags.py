# SPDX-License-Identifier: Apache-2.0
"""32-bit flags in device memory, waited on and written by the stream itself.

``cuStreamWaitValue32`` makes a stream wait until a word in device memory
holds a value; ``cuStreamWriteValue32`` writes one once the stream's earlier
work is done (with a memory barrier, so that work's writes are visible
first). Both are stream operations: a CUDA graph captures them, and the wait
occupies no SM, so a peer process on the same GPU keeps running. The word
may live in another process's allocation opened through CUDA IPC.
"""

from __future__ import annotations

import torch


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "the AFD ipc connector needs cuda-python (`pip install cuda-python`) for "
            "stream memory operations"
        ) from e
    return driver


def _check(result: tuple, what: str) -> None:
    driver = _driver()
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err}")


def _on_current_stream(op: str, flag: torch.Tensor, value: int, flags) -> None:
    driver = _driver()
    stream = torch.cuda.current_stream().cuda_stream
    fn = getattr(driver, op)
    _check(fn(driver.CUstream(stream), driver.CUdeviceptr(flag.data_ptr()), value, flags), op)


def wait_flag(flag: torch.Tensor, value: int) -> None:
    """The current stream waits until ``flag`` (one int32) equals ``value``."""
    flags = _driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    _on_current_stream("cuStreamWaitValue32", flag, value, flags)


def write_flag(flag: torch.Tensor, value: int) -> None:
    """The current stream writes ``value`` to ``flag`` after its earlier work."""
    flags = _driver().CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    _on_current_stream("cuStreamWriteValue32", flag, value, flags)
