"""Where an engine's host time goes in decode steps: py-spy samples, read back.

``HostProfiler`` samples the engine core process (where the scheduler and
the model runner's host code run) with py-spy, idle threads included, and
writes the raw stacks. ``host_share`` reads them back for the engine core's
busy-loop thread and sorts each sample into

* **GPU wait**: the thread waits for the device (an event or stream
  synchronize, or a device-to-host copy that needs the step's results);
* **idle**: the loop waits for requests (between generations);
* **host**: everything else, the host's own work for the step: scheduling,
  input preparation, kernel and graph launches, output handling; of it,
  **AFD's**: samples whose innermost AFD frame is AFD's own code (control
  payloads, data-plane calls, step marks), not a wrapper around vLLM's.

With vLLM's asynchronous scheduling the host prepares step n+1 while the GPU
runs step n, so host work costs time only where it exceeds the GPU's; the
host share times the step time is the host's time per step either way, and
is what an AFD attention engine and a colocated one are compared by.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENGINE_LOOP = "run_busy_loop"
"""The engine core's busy loop: its thread is the one judged."""
GPU_WAIT_LEAVES = ("synchronize", "_to_list")
"""Leaf Python functions that wait for the device: torch's synchronize
wrappers (events, streams, the device), and vLLM's copy of sampled tokens
to the host (an event wait)."""
IDLE_FRAMES = ("_process_input_queue",)
"""The busy loop waiting for new requests."""
AFD_MODULES = ("vllm/afd/", "vllm/distributed/afd_transfer/")
AFD_WRAPPERS = (
    "afd_step.<locals>.step",
    "redo_on_ffn_loss.<locals>.run",
    "rerun_on_ffn_loss",
    "rerun_announced_on_ffn_loss",
    "_attach_attention_stats.<locals>.get_output_with_stats",
)
"""AFD frames that only call vLLM's own step code: a sample below them, in
vLLM's code, is vLLM's host time, not AFD's."""


def py_spy() -> str:
    """The py-spy binary: on ``PATH``, beside this Python (a virtual
    environment), or in a ``pip install --target`` folder on the path."""
    found = shutil.which("py-spy")
    places = [Path(sys.executable).parent] + [Path(entry) / "bin" for entry in sys.path]
    for place in [] if found else places:
        if (place / "py-spy").is_file():
            found = str(place / "py-spy")
            break
    if not found:
        raise SystemExit("py-spy is needed for host profiles: pip install py-spy")
    return found


class HostProfiler:
    """py-spy recording process ``pid`` (the engine core) until ``stop``.
    Given the pid, ``start`` returns once py-spy is attached to that very
    process; following this process's children (``--subprocesses``) it
    attaches to them only once it has found them, and one window of 16
    short steps (15 ms each) got no sample of the engine core."""

    def __init__(self, directory: Path, name: str, pid: int, rate: int = 1000) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}.txt"
        self._cmd = [py_spy(), "record", "--pid", str(pid), "--idle", "--threads",
                     "--nonblocking", "--rate", str(rate), "--format", "raw",
                     "--output", str(self.path)]  # fmt: skip
        self._log = directory / f"{name}.py-spy.log"
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30) -> None:
        """Start sampling; returns once py-spy has attached and samples (a
        SIGINT before that would end it without a profile)."""
        with self._log.open("w") as sink:
            self._proc = subprocess.Popen(self._cmd, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while "Sampling process" not in self._log.read_text():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"py-spy did not start sampling:\n{self._log.read_text()}")
            time.sleep(0.01)

    def stop(self) -> Path:
        assert self._proc is not None, "stop before start"
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if not self.path.is_file():
            raise SystemExit(f"py-spy wrote no profile; it printed:\n{self._log.read_text()}")
        return self.path


@dataclass
class HostShare:
    """The engine core loop thread's samples, sorted (module docstring)."""

    host: int
    gpu_wait: int
    idle: int
    afd: int
    """Host samples in AFD's own code."""
    top_host_leaves: list[tuple[str, float]]
    """The leaf frames of host samples, with their share of the busy samples."""

    @property
    def busy(self) -> int:
        return self.host + self.gpu_wait

    @property
    def host_fraction(self) -> float:
        """Host samples over the loop's busy (non-idle) samples."""
        return self.host / self.busy


def _function(frame: str) -> str:
    """``Class.method (file:line)`` -> ``method``."""
    return re.sub(r" \(.*", "", frame).rsplit(".", 1)[-1]


def host_share(path: Path, top: int = 12) -> HostShare:
    """Read ``path`` (py-spy raw stacks) for the engine core's loop thread."""
    counts = collections.Counter()
    leaves = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [_function(f) for f in stack.split(";")]
        if ENGINE_LOOP not in frames:
            continue
        if any(f in IDLE_FRAMES for f in frames):
            counts["idle"] += int(n)
        elif frames[-1] in GPU_WAIT_LEAVES:
            counts["gpu_wait"] += int(n)
        else:
            counts["host"] += int(n)
            leaves[re.sub(r" \(.*", "", stack.rsplit(";", 1)[-1])] += int(n)
            afd = [f for f in stack.split(";") if any(m in f for m in AFD_MODULES)]
            if afd and re.sub(r" \(.*", "", afd[-1]) not in AFD_WRAPPERS:
                counts["afd"] += int(n)
    if not counts["host"] + counts["gpu_wait"]:
        raise SystemExit(f"{path}: no samples of the engine core's loop ({ENGINE_LOOP})")
    busy = counts["host"] + counts["gpu_wait"]
    return HostShare(
        host=counts["host"],
        gpu_wait=counts["gpu_wait"],
        idle=counts["idle"],
        afd=counts["afd"],
        top_host_leaves=[(leaf, n / busy) for leaf, n in leaves.most_common(top)],
    )


if __name__ == "__main__":
    # Read saved profiles again: python3 -m vllm_afd_dev.bench.host_profile FILE...
    for name in sys.argv[1:]:
        share = host_share(Path(name))
        print(f"{name}: {share.host} host samples ({share.afd} in AFD's code), "
              f"{share.gpu_wait} GPU wait, {share.idle} idle; host share "
              f"{share.host_fraction:.2f}")  # fmt: skip
