# SPDX-License-Identifier: Apache-2.0
"""The ``ipc`` connector: CUDA IPC buffers with flags the GPU waits on.

Every attention rank allocates one device buffer holding slots of hidden
states each way (one per stage, or for one-stage steps one per layer parity
and one for the last layer: ``resume.exchange_slot``), and a page of flags,
one per slot each way, in shared host memory (``SharedFlags``); it shares
both with its FFN rank (the CUDA IPC handle and the page's name travel in
its hello). A transfer is a copy into the slot followed by
``cuStreamWriteValue32``, which raises the flag to a value naming the layer;
the receiver's stream waits with ``cuStreamWaitValue32`` until the flag
holds it, lowers the flag to a value saying the layer was taken, and reads
the slot. Everything is a stream operation, so CUDA
graphs capture it and replay it, and no host thread waits. It works for two
processes on one GPU (where NCCL refuses) and across the GPUs of one node
that have peer access: an FFN rank on another GPU maps each peer's buffer
into its own GPU's context and its stream writes and waits on it over
NVLink. The handshake refuses a peer whose GPU the FFN rank cannot map (no
peer access, or not visible to it).

Under MPS (``ipc_signal`` "auto", the default, or "kernel") the transfers
signal with the flag kernels instead (``flag_kernels``): a send is one
copy kernel that raises its flag, a receive one single-block kernel that
spins until the flag is raised, on flags at the end of the buffer; the
round trip takes about half as long. The host page's flags are then the
spins' release words. The attention rank chooses once, and its hello tells
the FFN rank, which follows.

The attention rank owns its buffer and flags because it outlives FFN ranks.
With failover it keeps its forward in flight when the FFN rank is lost: its
waits stay blocked, the flags' values say which layer each peer stands at
(``resume``), and the replacement maps the same buffer and answers from
there. Its captured graphs, which hold the buffer's addresses, replay
unchanged.

One slot per direction and stage is enough for the transfers: the attention
side writes layer L+1's input only after it has waited for layer L's output,
which the FFN side sends only after it has consumed layer L's input. The
slots by layer parity are for failover: a peer one layer ahead of another
still holds its rows of the layer before.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.afd_transfer.afd_connector.base import AFDDataPlane
from vllm.distributed.afd_transfer.afd_connector.gpus import (
    device_uuid,
    is_mps_client,
    reach_facts,
)
from vllm.distributed.afd_transfer.afd_connector.ipc_slots import (
    SIGNALS,
    TO_ATTENTION,
    TO_FFN,
    FlagReleaser,
    IpcBufferLayout,
    IpcSlots,
    export_cuda_tensor,
    import_cuda_tensor,
)
from vllm.distributed.afd_transfer.flag_kernels import flag_kernels
from vllm.distributed.afd_transfer.payload import TokenLayout
from vllm.distributed.afd_transfer.resume import exchange_slot
from vllm.distributed.afd_transfer.stream_flags import SharedFlags
from vllm.logger import init_logger

logger = init_logger(__name__)


def unreachable_peers(ffn: dict[str, Any], peer_gpus: dict[int, str]) -> list[str]:
    """Why the FFN rank, whose ``reach_facts`` are ``ffn``, cannot map the
    buffers of attention ranks on ``peer_gpus`` (GPU UUID by rank); empty if
    it can map every one."""
    problems = []
    for rank, gpu in sorted(peer_gpus.items()):
        if gpu in ffn["reaches"]:
            continue
        why = "has no peer access to" if gpu in ffn["visible"] else "does not see"
        problems.append(
            f"attention rank {rank} runs on GPU {gpu}, which the FFN rank's GPU {ffn['gpu']} "
            f"{why}, so the FFN rank cannot map its ipc buffers."
        )
    if problems:
        problems.append(
            "Use the nccl connector between GPUs without peer access, or put the roles on "
            "GPUs that have it (nvidia-smi topo -p2p r) and that the FFN rank sees "
            "(CUDA_VISIBLE_DEVICES)."
        )
    return problems


def chosen_signal(configured: str, mps_client: bool | None) -> str:
    """The signal of an attention rank configured with ``configured`` (an
    ``ipc_signal``), an MPS client or not (None: unknown): "auto" spins
    only where the peer's kernels run beside the spin."""
    if configured == "auto":
        return "kernel" if mps_client else "stream"
    return configured


def attention_signal_problem(signal: str, mps_client: bool | None) -> str | None:
    """Why an attention rank, an MPS client or not (None: unknown), cannot
    signal with ``signal``; None if it can."""
    if signal != "kernel" or mps_client:
        return None
    return (
        'ipc_signal "kernel" spins on the GPU while the peer computes, which needs MPS, '
        "and this process is not an MPS client"
        + (" (the CUDA driver cannot tell)" if mps_client is None else "")
        + '. Set "mps": "start" in the AFD config, start a control daemon '
        '(nvidia-cuda-mps-control -d), or use ipc_signal "stream".'
    )


def peer_signal_problem(
    rank: int, signal: object, shares_the_gpu: bool, mps_client: bool | None
) -> str | None:
    """Why the FFN rank cannot signal as attention rank ``rank``'s hello
    says (``signal``); None if it can. ``shares_the_gpu``: the two run on
    one GPU; ``mps_client``: the FFN rank runs under MPS there."""
    if signal not in SIGNALS:
        return (
            f"attention rank {rank} signals ipc transfers with {signal!r}, which this FFN "
            f"rank does not know ({', '.join(SIGNALS)}); run the same vLLM-AFD version on "
            "both roles."
        )
    if signal == "kernel" and shares_the_gpu and not mps_client:
        return (
            f"attention rank {rank} runs under MPS and its ipc transfers spin on the GPU, "
            "but this FFN rank, on the same GPU, is not a client of that MPS daemon: they "
            "would take turns on the GPU. Start it with the attention rank's "
            'CUDA_MPS_PIPE_DIRECTORY, let the deployment start both ("mps": "start"), '
            'or set ipc_signal "stream" on the attention side.'
        )
    return None


def mapped_memory(facts: dict[str, Any]) -> tuple:
    """What of an attention rank's device facts names the memory an FFN
    rank maps (its buffer, flags page, rows and signal); equal for two
    hellos of one attention rank, whose buffer outlives its FFN ranks."""
    buffer = facts.get("buffer")
    if not isinstance(buffer, dict):
        return (None,)
    return (
        *(
            buffer.get(k)
            for k in ("handle", "size_bytes", "offset_bytes", "numel", "tensor_offset")
        ),
        facts.get("flags"),
        facts.get("rows"),
        facts.get("signal"),
    )


def parse_standby_offer(
    offer: dict[str, Any], peer_ranks: list[int]
) -> tuple[dict[int, dict[str, Any]], list[TokenLayout]]:
    """The peers' device facts by rank and the layouts in a served rank's
    offer (``IpcDataPlane.standby_offer``); ``ValueError`` if it is
    malformed or names other peers than ``peer_ranks``."""
    try:
        facts = {int(rank): dict(f) for rank, f in offer["peers"].items()}
        layouts = [tuple(tuple(int(n) for n in stage) for stage in key)
                   for key in offer["layouts"]]  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed offer ({type(e).__name__}: {e})") from e
    if sorted(facts) != peer_ranks:
        raise ValueError(f"it offers attention ranks {sorted(facts)}, not {peer_ranks}")
    return facts, layouts


class IpcDataPlane(AFDDataPlane):
    """Implements ``InPlaceDataPlane`` too."""

    device_waits = True

    def __init__(self, spec, exchange) -> None:
        super().__init__(spec, exchange)
        self._rows = spec.max_rows
        self._slots: IpcSlots | None = None
        """Attention side: this rank's buffer."""
        self._buffer_export: dict[str, Any] = {}
        """Attention side: its buffer's CUDA IPC handle (``_device_facts``)."""
        self._peer_slots: list[IpcSlots] = []
        """FFN side: each peer's buffer, in peer order."""
        self._releaser: FlagReleaser | None = None
        self._mapped_in_advance: dict[int, tuple] | None = None
        """A standby: the peers' memory it mapped before taking over
        (``mapped_memory`` by rank), which its graphs captured since hold."""
        if spec.role == "ffn" and torch.cuda.is_available():
            self._load_flag_kernels_under_mps()

    def _load_flag_kernels_under_mps(self) -> None:
        if is_mps_client(torch.cuda.current_device()):
            # Loaded before the handshake: a replacement then loads no module
            # (which may synchronize its context) while its peers' forwards
            # wait on it.
            flag_kernels(torch.cuda.current_device())

    def _slot(self, layer: int, stage: int) -> int:
        return exchange_slot(layer, stage, self.exchange.stages, self.spec.num_layers)

    def _layout(self, rows: int) -> IpcBufferLayout:
        spec = self.spec
        return IpcBufferLayout(rows, (spec.input_width, spec.output_width), spec.dtype)

    def device_facts(self) -> dict[str, Any]:
        if self._slots is None:  # kept across failovers: the graphs hold their addresses
            layout = self._layout(self._rows)
            buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8, device="cuda")
            flags = SharedFlags(layout.num_host_words)
            self._slots = IpcSlots(layout, buffer, flags, self._signal())
            # Exported once, now, for every FFN rank to come: each export
            # records an event on this thread's stream that the importer's
            # stream waits for, and a replacement's export would record it
            # behind the forward in flight, which waits for the replacement.
            self._buffer_export = export_cuda_tensor(buffer)
        return {**reach_facts(), "rows": self._rows, "flags": self._slots.flags.name,
                "buffer": self._buffer_export, "signal": self._slots.signal}  # fmt: skip

    def _signal(self) -> str:
        """Attention side: the signal ``ipc_signal`` asks for, once this
        rank can use it."""
        configured, device = self.spec.afd_config.ipc_signal, torch.cuda.current_device()
        mps_client = is_mps_client(device) if configured != "stream" else None
        problem = attention_signal_problem(configured, mps_client)
        if problem is not None:
            raise RuntimeError(f"AFD attention rank {self.spec.rank}: {problem}")
        signal = chosen_signal(configured, mps_client)
        if signal == "kernel":
            flag_kernels(device)  # compiled now, not in the first step
        how = "flag kernels" if signal == "kernel" else "stream memory operations"
        logger.info("AFD attention rank %d: ipc transfers signal with %s", self.spec.rank, how)
        return signal

    def standby_offer(
        self, peer_devices: dict[int, dict[str, Any]], layouts: list[TokenLayout] | None
    ) -> dict[str, Any] | None:
        if layouts is None:
            return None
        peers = {str(rank): facts for rank, facts in peer_devices.items()}
        return {"peers": peers, "layouts": [list(map(list, key)) for key in layouts]}

    def prepare_in_advance(self, offer: dict[str, Any]) -> list[TokenLayout]:
        """Map the peers' buffers and flags that the served rank maps, from
        their hellos it offers; the layouts it serves in graphs are this
        standby's to capture against them. Where that fails, the standby
        captures while serving, as any replacement does."""
        try:
            facts, layouts = parse_standby_offer(offer, list(self.spec.peer_ranks))
        except ValueError as e:
            logger.warning("AFD FFN standby: the served rank's offer is unusable (%s); this "
                           "standby captures its graphs while serving", e)  # fmt: skip
            return []
        problems = self.check_peer_devices(facts)
        if problems:
            logger.warning("AFD FFN standby: cannot map the peers' buffers in advance (%s); "
                           "this standby captures its graphs while serving",
                           " ".join(problems))  # fmt: skip
            return []
        self._mapped_in_advance = {rank: mapped_memory(f) for rank, f in facts.items()}
        return layouts

    def check_peer_devices(self, facts: dict[int, dict[str, Any]]) -> list[str]:
        """Reach every peer's GPU and map its buffer, or say why not. A
        standby that mapped them in advance keeps those mappings, which its
        graphs hold, and refuses peers whose memory is not that memory."""
        if self._mapped_in_advance is not None:
            changed = [rank for rank in self.spec.peer_ranks
                       if mapped_memory(facts[rank]) != self._mapped_in_advance[rank]]  # fmt: skip
            if not changed:
                return []
            return [
                f"attention rank(s) {changed} are not those whose buffers this standby mapped "
                "and captured its graphs for before it took over: a new deployment has started "
                "since. Start a standby for it once it serves."
            ]
        gpus = {rank: str(f.get("gpu")) for rank, f in facts.items()}
        problems = unreachable_peers(reach_facts(), gpus)
        if problems:
            return problems
        own_gpu, mps_client = device_uuid(), is_mps_client(torch.cuda.current_device())
        for rank in self.spec.peer_ranks:
            rows, signal = facts[rank].get("rows"), facts[rank].get("signal")
            problem = peer_signal_problem(rank, signal, gpus[rank] == own_gpu, mps_client)
            if problem is None and (not isinstance(rows, int) or rows > self._rows):
                problem = (
                    f"attention rank {rank} runs up to {rows} tokens per step "
                    f"(max_num_batched_tokens), but this FFN rank takes at most {self._rows}; "
                    f"start the FFN rank with --max-num-batched-tokens {rows} or more."
                )
            if problem is None:
                layout = self._layout(rows)
                try:
                    handle = facts[rank].get("buffer")
                    buffer = import_cuda_tensor(handle, torch.cuda.current_device())
                    flags = SharedFlags(layout.num_host_words, str(facts[rank].get("flags")))
                    self._peer_slots.append(IpcSlots(layout, buffer, flags, signal))
                    continue
                except (ValueError, RuntimeError, OSError, ImportError) as e:
                    problem = f"could not map attention rank {rank}'s ipc buffer and flags: {e}"
            self.close()  # what was mapped of the other peers
            return [problem]
        return []

    def serve(self) -> dict[str, Any]:
        return {}  # the peers' buffers are mapped already (check_peer_devices)

    def join(self, data_plane: dict[str, Any]) -> None:
        # The peers' buffers are mapped, and an attention rank's own is kept
        # across failovers. An FFN rank that takes a lost one's place finds
        # the release words its predecessor's last spin was ended with.
        if self.spec.role == "ffn":
            for slots in self._peer_slots:
                if slots.signal == "kernel":
                    slots.lower_release_words(TO_FFN)

    def end_lost_rank_waits(self) -> None:
        # Under MPS a process killed in a spinning wait leaves that kernel
        # running, and the MPS server lets no new client in until it ends
        # (docs/gpu-runs.md, 2026-12-05): its release words end it. The
        # kernel then leaves its flag as it was, so that the flags still say
        # where this rank's forward stands.
        if self._slots.signal == "kernel":
            self._slots.raise_flags(TO_FFN)

    def begin_step_on_device(self, step_id: int) -> None:
        if not torch.cuda.is_current_stream_capturing():  # a capture runs nothing
            self._slots.begin_step(step_id)

    def exchange_words(self) -> tuple[int, list[int], list[int]] | None:
        return self._slots.exchange_words()

    # attention side
    def send_hidden_states(self, hidden_states: torch.Tensor, layer: int, stage: int) -> None:
        if hidden_states.shape[0]:
            self._slots.send(TO_FFN, self._slot(layer, stage), hidden_states, layer)

    def recv_ffn_output(self, out: torch.Tensor, layer: int, stage: int) -> None:
        if out.shape[0]:
            rows = self._slots.receive(TO_ATTENTION, self._slot(layer, stage), out.shape[0], layer)
            out.copy_(rows)

    # FFN side: the returned views stay valid until send_ffn_output, because
    # a peer writes its next input only after it has received this output.
    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        slot, resume = self._slot(layer, stage), self.exchange.resuming
        return [
            slots.rows(TO_FFN, slot, n)
            if resume is not None and resume.rows_kept_at(peer, layer, stage)
            else slots.receive(TO_FFN, slot, n, layer)
            for peer, (slots, n) in enumerate(zip(self._peer_slots, token_counts, strict=True))
        ]

    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        slot, resume = self._slot(layer, stage), self.exchange.resuming
        for peer, (slots, out) in enumerate(zip(self._peer_slots, outputs, strict=True)):
            if out.shape[0] and not (resume is not None and resume.answered_at(peer, layer)):
                slots.send(TO_ATTENTION, slot, out, layer)

    def abort(self) -> None:
        """Release every wait of this rank on the lost peer (once; nothing
        is left to release once the connector has closed)."""
        if self._releaser is None and (self._slots is not None or self._peer_slots):
            if self.spec.role == "attention":
                self._releaser = FlagReleaser([self._slots], TO_ATTENTION)
            else:
                self._releaser = FlagReleaser(self._peer_slots, TO_FFN)

    def _stop_releasing(self) -> None:
        if self._releaser is not None:
            self._releaser.stop()
            self._releaser = None

    def close(self) -> None:
        self._stop_releasing()
        for slots in [self._slots, *self._peer_slots]:
            if slots is not None:
                slots.flags.close()
        self._slots = None
        self._peer_slots = []
