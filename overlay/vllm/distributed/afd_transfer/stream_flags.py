# SPDX-License-Identifier: Apache-2.0
"""32-bit flags that streams wait on and write, kept in shared host memory.

``cuStreamWaitValue32`` makes a stream wait until a word holds a value;
``cuStreamWriteValue32`` writes one once the stream's earlier work is done
(with a memory barrier, so that work's writes are visible first). Both are
stream operations: a CUDA graph captures them, and the wait occupies no SM,
so a peer process on the same GPU keeps running.

The words live in a page of host memory that every process of a connection
maps (a file in /dev/shm) and registers with CUDA, so that its streams reach
them. A host store then releases any wait: a process that lost its peer
raises the flags it waits on from a thread. Flags in device memory could
only be raised by work on the GPU, and a stream of the same process may
share a hardware queue with the blocked stream and wait behind it forever.

The owner registers its page with Python's resource tracker, the process
that removes shared memory a process leaves behind: a SIGKILLed attention
rank cannot remove its page itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import secrets
from multiprocessing import resource_tracker

import torch

_PAGE = mmap.PAGESIZE
_NAME = re.compile(r"afd-flags-[0-9a-f]{16}")
_SHM_DIR = "/dev/shm"


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "the AFD ipc connector needs cuda-python (`pip install cuda-python`) for "
            "stream memory operations"
        ) from e
    return driver


def check_cuda(result: tuple, what: str):
    """The value a cuda-python driver call returned, or a RuntimeError
    naming the call and its error."""
    driver = _driver()
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err}")
    return result[1] if len(result) > 1 else None


class SharedFlags:
    """``count`` int32 flags in a page of shared host memory.

    ``SharedFlags(count)`` creates the page (its owner unlinks it on
    ``close``, or the resource tracker once the owner is gone);
    ``SharedFlags(count, name)`` opens another process's. Host
    reads and stores go through ``words``; ``map_to_gpu`` registers the page
    with CUDA, after which ``address(i)`` is flag i's device address for
    ``wait_flag`` and ``write_flag``."""

    def __init__(self, count: int, name: str | None = None) -> None:
        assert 4 * count <= _PAGE
        self.owner = name is None
        if name is None:
            name = f"afd-flags-{secrets.token_hex(8)}"
            mode = os.O_RDWR | os.O_CREAT | os.O_EXCL
        elif not _NAME.fullmatch(name):
            raise ValueError(f"not an AFD flags page name: {name!r}")
        else:
            mode = os.O_RDWR
        self.name = name
        fd = os.open(os.path.join(_SHM_DIR, name), mode, 0o600)
        try:
            if self.owner:
                os.ftruncate(fd, _PAGE)
            elif os.fstat(fd).st_size != _PAGE:
                raise ValueError(f"flags page {name!r} has the wrong size")
            self._mmap = mmap.mmap(fd, _PAGE)
        finally:
            os.close(fd)
        if self.owner:
            resource_tracker.register(self._tracked_name, "shared_memory")
        self.words = torch.frombuffer(self._mmap, dtype=torch.int32, count=count)
        self._host = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._device: int | None = None

    @property
    def _tracked_name(self) -> str:
        # the tracker removes it with shm_unlink, which takes "/name"
        return "/" + self.name

    def map_to_gpu(self) -> None:
        """Register the page with CUDA (the current context), once."""
        if self._device is not None:
            return
        driver = _driver()
        register = driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP
        check_cuda(driver.cuMemHostRegister(self._host, _PAGE, register), "cuMemHostRegister")
        pointer = check_cuda(driver.cuMemHostGetDevicePointer(self._host, 0),
                             "cuMemHostGetDevicePointer")  # fmt: skip
        self._device = int(pointer)

    def address(self, index: int) -> int:
        assert self._device is not None, "map_to_gpu first"
        return self._device + 4 * index

    def close(self) -> None:
        """Unregister the page; the owner also removes its file. The mapping
        itself goes with the last view of ``words``."""
        if self._device is not None:
            check_cuda(_driver().cuMemHostUnregister(self._host), "cuMemHostUnregister")
            self._device = None
        if self.owner:
            self.owner = False
            resource_tracker.unregister(self._tracked_name, "shared_memory")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_SHM_DIR, self.name))


def _on_current_stream(op: str, address: int, value: int, flags) -> None:
    driver = _driver()
    stream = torch.cuda.current_stream().cuda_stream
    fn = getattr(driver, op)
    check_cuda(fn(driver.CUstream(stream), driver.CUdeviceptr(address), value, flags), op)


def wait_flag(address: int, value: int) -> None:
    """The current stream waits until the flag at ``address`` reaches
    ``value``: ``(int32)(flag - value) >= 0``, so that a host can end the
    wait with a larger value (``resume.RELEASE``)."""
    flags = _driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    _on_current_stream("cuStreamWaitValue32", address, value, flags)


def write_flag(address: int, value: int) -> None:
    """The current stream writes ``value`` to the flag at ``address`` after
    its earlier work."""
    flags = _driver().CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    _on_current_stream("cuStreamWriteValue32", address, value, flags)
