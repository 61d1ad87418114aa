# SPDX-License-Identifier: Apache-2.0
"""The interface every AFD connector implements.

A connector joins one attention rank to its FFN rank, or one FFN rank to all
of its attention peers. The control plane (rendezvous, handshake, one payload
per step) is the same for every connector and lives here; subclasses supply
the data plane: how hidden states reach the FFN rank and how its output comes
back, per layer and per stage.

Attention rank ``a`` belongs to FFN rank ``a // (A/F)``, where it is peer
``a % (A/F)``. On the FFN side, lists of tensors are in peer order.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.afd_transfer.auth import load_secret
from vllm.distributed.afd_transfer.control.client import (
    ControlClient,
    ask_served_rank_as_standby,
)
from vllm.distributed.afd_transfer.control.server import ControlServer
from vllm.distributed.afd_transfer.handshake import (
    AFDConnectionError,
    AFDFingerprint,
    AFDPeerGoneError,
    AFDPeerLostError,
)
from vllm.distributed.afd_transfer.payload import (
    ControlPayload,
    TokenLayout,
    merge_peer_payloads,
)
from vllm.distributed.afd_transfer.resume import (
    STEP_MASK,
    PeerPosition,
    ResumePlan,
    position_from_flags,
)
from vllm.distributed.afd_transfer.step_stats import (
    NULL_TIMELINE,
    GraphStepStats,
    StepKind,
    StepTimeline,
    StepTimes,
)
from vllm.distributed.afd_transfer.watchdog import (
    ControlConnectionWatchdog,
    PeerLossWatchdog,
    raise_in_thread,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


class AFDConnectorBase(ABC):
    """One rank's end of the AFD planes."""

    device_waits: bool = False
    """True for connectors whose transfers wait on the device (stream memory
    operations, NCCL kernels): a lost peer would leave the GPU waiting
    forever, so losing one releases those waits (``_abort_data_plane``)."""

    prepares_in_advance: bool = False
    """True for connectors whose FFN-side CUDA graphs hold the peers' memory
    (ipc): a standby maps it before it takes over (``prepare_standby``), so
    that it can capture its graphs in advance."""

    def __init__(self, vllm_config: VllmConfig, rank: int, input_width: int) -> None:
        afd = vllm_config.afd_config
        assert afd is not None, "AFD connectors need VllmConfig.afd_config"
        self.afd_config = afd
        self.role = afd.role
        self.rank = rank
        """Attention rank (role "attention") or FFN rank (role "ffn")."""
        self.fingerprint = AFDFingerprint.from_vllm_config(vllm_config)
        self.ffn_rank = afd.ffn_rank_of(rank) if self.role == "attention" else rank
        self.peer_ranks = afd.attention_ranks_of(self.ffn_rank)
        """The attention ranks served by ``ffn_rank``, in peer order."""
        self.host = afd.host
        self.port = afd.port + self.ffn_rank
        self._server: ControlServer | None = None
        self._client: ControlClient | None = None
        self._next_step = 0
        self._closed = False
        self._on_close: list[Callable[[], None]] = []
        self.num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.step_stages = 1
        """Stages of the step announced (attention) or received (FFN) last."""
        self.input_width = input_width
        """Columns of the rows sent to the FFN rank (hidden states, plus router
        logits when the gate runs on the attention side)."""
        self.output_width = vllm_config.model_config.get_hidden_size()
        """Columns of the FFN output rows."""
        self.dtype = vllm_config.model_config.dtype
        self.request_tokens = dict.fromkeys(self.peer_ranks, 0)
        """FFN side: tokens of real steps (no warm-up, dummy or profile
        forward) that each attention peer has sent, per layer."""
        self.graph_stats = GraphStepStats()
        """Attention side: the steps announced, by how they run."""
        self._captured_totals: set[int] = set()
        self.transfer_timeout_s: float | None = None
        """Bound on each transfer of the current step: ``timeout_s`` in real
        steps; None (as long as the peer lives) in the forwards before
        serving, where a peer may compile its model for as long as it takes."""
        self.layouts_for_standby: Callable[[], list[TokenLayout] | None] = lambda: None
        """FFN side, set by the runner: the token layouts this rank has graphs
        for, once it serves (None before)."""
        self.peer_devices: dict[int, dict[str, Any]] = {}
        """FFN side: each attention peer's device facts from its hello
        (``_device_facts``), by rank."""
        self.timeline = (
            StepTimeline(
                on_gpu=vllm_config.device_config.device_type == "cuda",
                from_step_start=self.role == "attention",
            )
            if afd.time_steps
            else NULL_TIMELINE
        )
        """Both sides, with ``time_steps``: each real step's compute and exchange."""
        self.tokens_sent = 0
        """Attention side: tokens of real steps this rank sent, per layer."""
        self.step_time_totals = StepTimes()
        """Attention side, with ``time_steps``: the real steps' times, summed."""
        if afd.time_steps and self.role == "attention":
            self.timeline.observers.append(self.step_time_totals.add)
        self._watchdog: ControlConnectionWatchdog | PeerLossWatchdog | None = None
        self._model_thread = 0
        self._stop_reason: str | None = None
        """FFN side: why this rank stopped serving, once it has."""
        self._ffn_loss_logged = False
        self._stop_lock = threading.Lock()
        self.step_failed = False
        """Attention side: a step of this worker raised (``afd_step``), so its
        shutdown message tells the FFN rank it did not finish its work."""
        self._in_flight: tuple[ControlPayload, GraphStepStats, int] | None = None
        """Attention side, with failover that redoes the forward (not in
        place): the step announced last, which a replacement FFN rank runs
        again if the FFN rank is lost in it, and the step counters and tokens
        sent from before it was announced."""
        self.start_replacement: Callable[[], Callable[[], None]] | None = None
        """Attention side, with `spawn_ffn`: starts a new FFN process in a lost
        one's place, returning the check that it still runs (``connect``'s
        ``still_waiting``). Without it a replacement is started by hand, or
        is a standby."""
        self.failovers = 0
        """Attention side: FFN ranks replaced so far."""
        self.failover_pause_s = 0.0
        """Attention side: seconds spent waiting for those replacements, from
        each loss to the replacement's handshake."""
        self._reported: dict[str, float] = {}
        """Attention side: the figures ``attention_stats_to_report`` has reported."""
        self._report_lock = threading.Lock()
        self._announced: collections.deque[ControlPayload] = collections.deque(maxlen=16)
        """Attention side, failing over in place: the steps announced last,
        which a replacement may need again (the GPU runs a step or two
        behind the host)."""
        self._announce_lock = threading.Lock()
        self._failover: threading.Event | None = None
        """Attention side: set while an in-place failover runs; the event is
        set when it ends."""
        self._failover_error: AFDConnectionError | None = None
        """Attention side: why the in-place failover failed, once it has."""
        self._resume: ResumePlan | None = None
        """FFN side, a replacement: where to resume, until its first step."""
        self._resuming: ResumePlan | None = None
        """FFN side: the plan of the step being resumed, until its first
        layer is answered."""

    @property
    def peer_index(self) -> int:
        """Attention side: this rank's index among its FFN rank's peers."""
        return self.peer_ranks.index(self.rank)

    @property
    def group_size(self) -> int:
        """Ranks in the FFN rank's data-plane group: the FFN rank and its peers."""
        return 1 + len(self.peer_ranks)

    @property
    def group_rank(self) -> int:
        """Rank in that group: the FFN rank is 0, peer p is p + 1."""
        return 0 if self.role == "ffn" else 1 + self.peer_index

    @property
    def local_address(self) -> str:
        """This rank's own address towards its peers: the FFN rank's `host`;
        on an attention rank the local end of its control connection (on
        another node, the address of the interface that reaches `host`)."""
        if self._client is None:
            return self.host
        return self._client.socket.getsockname()[0]

    # ---------------------------------------------------------------- set-up
    def connect(self, still_waiting: Callable[[], None] = lambda: None) -> None:
        """Rendezvous and handshake, then bring up the data plane."""
        timeout = self.afd_config.startup_timeout_s
        secret = load_secret(self.afd_config.secret_file)
        if self.role == "ffn":
            self._server = ControlServer(
                self.host,
                self.port,
                self.peer_ranks,
                self.fingerprint,
                timeout,
                secret,
                liveness_s=self.afd_config.timeout_s,
                standby=self.afd_config.standby,
                num_layers=self.num_layers,
            )
            self._server.standby_offer = self._standby_offer
            data_plane = self._server.accept_peers(
                self._serve_data_plane, self._record_peer_devices
            )
            # A replacement FFN rank resumes the step count of the rank it replaces.
            self._next_step = self._server.resume_step
            self._resume = self._server.resume
        else:
            self._client = self._control_client(timeout, "startup_timeout_s")
            welcome = self._client.connect(self.fingerprint, still_waiting, self._device_facts())
            data_plane = welcome.data_plane
        self._join_data_plane(data_plane)
        atexit.register(self.close)
        self._model_thread = threading.get_ident()  # the worker thread that connects
        self._watch()
        logger.info(
            "AFD %s rank %d connected over %s (FFN rank %d, attention peers %s)",
            self.role,
            self.rank,
            self.afd_config.connector,
            self.ffn_rank,
            self.peer_ranks,
        )

    def prepare_standby(self, capture_graphs: bool) -> list[TokenLayout]:
        """FFN side, a standby, before it waits for its port: check it
        against the FFN rank it backs (``ask_served_rank_as_standby``). A
        connector whose CUDA graphs hold its peers' memory
        (``prepares_in_advance``) then waits for that rank to serve, maps
        the memory it offers, and returns the token layouts it serves in
        graphs, for this standby to capture before it takes over; the others
        return none."""
        secret = load_secret(self.afd_config.secret_file)
        waiting = False
        while True:
            answer = ask_served_rank_as_standby(self.host, self.port, self.fingerprint, secret)
            if answer is None:
                return []
            wants_offer = capture_graphs and self.prepares_in_advance
            if not wants_offer or answer.offer is not None:
                logger.info("AFD FFN standby: it can take the place of the FFN rank on %s:%d "
                            "(same model, topology, connector and graph mode)",
                            self.host, self.port)  # fmt: skip
                return self._prepare_in_advance(answer.offer) if wants_offer else []
            if not waiting:
                waiting = True
                logger.info("AFD FFN standby: waiting for the FFN rank on %s:%d to serve, to "
                            "capture its graphs in advance", self.host, self.port)  # fmt: skip
            time.sleep(1.0)

    def _standby_offer(self) -> dict[str, Any] | None:
        """FFN side, serving: what a standby backing this rank prepares its
        takeover with (``_prepare_in_advance``); None while not known yet."""
        return {}

    def _prepare_in_advance(self, offer: dict[str, Any]) -> list[TokenLayout]:
        """Standby side, with ``prepares_in_advance``: join what the served
        rank offered and return the layouts to capture."""
        return []

    def _watch(self) -> None:
        """Each role watches its peers from a thread: a lost peer must end this
        rank even while it waits on that peer where no error reaches it."""
        if self.role == "attention":
            self._watchdog = ControlConnectionWatchdog(self._client.socket, self._ffn_rank_lost)
        else:
            self._watchdog = PeerLossWatchdog(self._server.lost_peers, self._attention_ranks_lost)
        self._watchdog.start()

    def _control_client(self, timeout_s: float, timeout_name: str) -> ControlClient:
        return ControlClient(
            self.host,
            self.port,
            self.rank,
            timeout_s,
            load_secret(self.afd_config.secret_file),
            liveness_s=self.afd_config.timeout_s,
            timeout_name=timeout_name,
        )

    # -------------------------------------------------------------- failover
    @property
    def can_fail_over(self) -> bool:
        """Attention side: whether losing the FFN rank means waiting for a
        replacement (``failover_timeout_s``) rather than ending."""
        return self._client is not None and self.afd_config.failover_timeout_s > 0

    @property
    def resumes_in_place(self) -> bool:
        """Attention side, with failover: the transfers wait on the device,
        so the forward in flight stays blocked where the FFN rank was lost
        and a replacement answers it from there (``resume``); elsewhere the
        forward fails and runs again (``replace_ffn_rank``)."""
        return self.device_waits and self.can_fail_over

    def replace_ffn_rank(self, cause: AFDConnectionError) -> None:
        """Attention side, with ``failover_timeout_s``, where transfers fail
        on the host: the FFN rank was lost during the step announced last
        (``cause`` says how). Connect to the FFN rank that takes its place,
        and rewind to that step, which the caller runs again. Re-raises
        ``cause`` if the FFN rank stopped the deployment on purpose; raises
        an error naming the lost rank if no replacement comes within
        ``failover_timeout_s``."""
        assert self._client is not None
        if self._in_flight is None or self._client.stop_notice(wait_s=0.5) is not None:
            raise cause
        step, graph_stats, tokens_sent = self._in_flight
        lost_at = time.monotonic()
        self._warn_waiting(f"to run step {step.step_id} again")
        client, welcome = self._connect_replacement(cause, lost_at, resume_step=step.step_id)
        self._client = client
        self._join_data_plane(welcome.data_plane)
        self._watch()
        self._next_step = step.step_id
        self.graph_stats, self.tokens_sent = graph_stats, tokens_sent
        self.timeline.abandon_step()
        self._count_failover(lost_at, f"running step {step.step_id} again")

    def _warn_waiting(self, what_for: str) -> None:
        logger.warning(
            "%s. Keeping this rank's requests and KV cache: waiting up to %.0f s for an FFN "
            "rank in its place, %s.",
            self.ffn_rank_lost_message(),
            self.afd_config.failover_timeout_s,
            what_for,
        )

    def _connect_replacement(self, cause: object, lost_at: float, **hello: Any):
        """Let go of the lost FFN rank, start a replacement where this rank
        starts them, and handshake with whichever FFN rank takes the place
        within ``failover_timeout_s`` (``hello``: ``ControlClient.connect``'s
        resume arguments). Returns the new client and its welcome."""
        self._watchdog.stop(join=True)  # no loss handling may run past here
        self._client.close()
        # A respawn ends the lost process first: nothing of it may write to
        # this rank's data plane once a replacement uses it.
        still_waiting = self.start_replacement() if self.start_replacement else lambda: None
        if not self.resumes_in_place:
            self._leave_data_plane()
        deadline = lost_at + self.afd_config.failover_timeout_s
        while True:
            client = self._control_client(
                max(0.1, deadline - time.monotonic()), "failover_timeout_s"
            )
            try:
                welcome = client.connect(
                    self.fingerprint, still_waiting, self._device_facts(), **hello
                )
                return client, welcome
            except AFDPeerGoneError as e:
                if time.monotonic() >= deadline:
                    raise self._no_replacement_error(cause, e) from e
                # A replacement that dies while it starts is itself replaced.
                logger.warning("AFD attention rank %d: %s; waiting for another", self.rank, e)
                if self.start_replacement:
                    still_waiting = self.start_replacement()
            except AFDConnectionError as e:
                raise self._no_replacement_error(cause, e) from e

    def _count_failover(self, lost_at: float, then: str) -> None:
        self.failovers += 1
        paused_s = time.monotonic() - lost_at
        self.failover_pause_s += paused_s
        logger.warning(
            "AFD attention rank %d: an FFN rank took the lost one's place after %.1f s "
            "(failover %d); %s",
            self.rank,
            paused_s,
            self.failovers,
            then,
        )

    def _no_replacement_error(self, cause: object, last: AFDConnectionError):
        return AFDConnectionError(
            f"AFD attention rank {self.rank}: lost the FFN rank at {self.host}:{self.port} "
            f"({cause}), and no FFN rank took its place within "
            f"{self.afd_config.failover_timeout_s:.0f} s: {last}"
        )

    def _start_failover(self) -> threading.Event:
        """Attention side, failing over in place, under ``_announce_lock``:
        the in-place failover, started once; its event is set when it ends."""
        if self._failover is None:
            self._failover = threading.Event()
            threading.Thread(target=self._fail_over_in_place, name="afd-failover",
                             daemon=True).start()  # fmt: skip
        return self._failover

    def _fail_over_in_place(self) -> None:
        """In a thread of its own: the GPU keeps this rank's forward in flight
        blocked on the lost FFN rank, and the model thread may wait on the
        GPU. Hand a replacement this rank's position, announce again the
        steps it resumes from, and let the GPU go on; or, with none in time,
        end as without failover."""
        lost_at, failover = time.monotonic(), self._failover
        self._end_lost_rank_waits()
        try:
            if self._client.stop_notice(wait_s=0.5) is not None:
                raise AFDConnectionError(self.ffn_rank_lost_message())
            self._warn_waiting("to answer the forward in flight where it stands")
            cause = self.ffn_rank_lost_message()
            client, welcome = self._connect_replacement(
                cause, lost_at, position=self._exchange_position
            )
            self._join_data_plane(welcome.data_plane)
            resume_step = welcome.data_plane["resume_step"]
            with self._announce_lock:
                again = [p for p in self._announced if p.step_id >= resume_step]
                if not again or again[0].step_id != resume_step:
                    raise AFDConnectionError(
                        f"AFD attention rank {self.rank}: the replacement resumes at step "
                        f"{resume_step}, which this rank no longer keeps "
                        f"(it keeps {[p.step_id for p in self._announced]})"
                    )
                for payload in again:
                    client.send_payload(payload)
                self._client = client
                self._watch()
                self._count_failover(lost_at, f"it resumes at step {resume_step}")
                self._failover = None
            failover.set()
        except AFDConnectionError as e:
            self._failover_error = e
            failover.set()
            logger.error("%s. Stopping this rank.", e)
            self._ffn_loss_logged = True
            self._stop_model_thread()

    def _exchange_position(self) -> PeerPosition:
        """Attention side, failing over in place: where this rank's forward in
        flight stands, read from its data plane once nothing of the lost FFN
        rank writes there. Raises ``AFDConnectionError`` if it cannot tell."""
        deadline = time.monotonic() + self.afd_config.timeout_s
        while (words := self._exchange_words()) is None:
            if time.monotonic() > deadline:
                raise AFDConnectionError(
                    f"AFD attention rank {self.rank}: its GPU did not finish starting a "
                    f"forward within {self.afd_config.timeout_s:.0f} s, so where its exchange "
                    "stands cannot be read"
                )
            time.sleep(0.01)
        word, to_ffn, to_attention = words
        with self._announce_lock:
            kept = list(self._announced)
        step = next((p for p in reversed(kept) if p.step_id & STEP_MASK == word), None)
        if step is None:
            raise AFDConnectionError(
                f"AFD attention rank {self.rank}: its GPU is in a step (low bits {word}) that "
                f"this rank no longer keeps (it keeps {[p.step_id for p in kept]})"
            )
        if not step.token_counts[0][self.peer_index]:
            position = PeerPosition(step.step_id + 1, 0)  # its layers exchange nothing
        else:
            position = position_from_flags(step.step_id, to_ffn, to_attention, self.num_layers)
        logger.info("AFD attention rank %d: the forward in flight stands at %s (flags by slot: "
                    "to the FFN rank %s, back %s)", self.rank, position,
                    [hex(w) for w in to_ffn], [hex(w) for w in to_attention])  # fmt: skip
        return position

    def _exchange_words(self) -> tuple[int, list[int], list[int]] | None:
        """Attention side, connectors that resume in place: the step word and
        the flags by slot each way (``IpcSlots.exchange_words``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume in place")

    def _end_lost_rank_waits(self) -> None:
        """Attention side, failing over in place: end what the lost FFN rank
        left waiting on the device, where that outlives it; by default
        nothing does."""
        return

    def _begin_step_on_device(self, step_id: int) -> None:
        """Attention side, connectors that resume in place: mark the start of
        step ``step_id`` where ``_exchange_words`` reads it."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume in place")

    def _announce(self, payload: ControlPayload) -> None:
        """Attention side: send ``payload``. Failing over in place, a lost
        FFN rank does not fail the step: the step waits for the failover,
        which announces it to the replacement."""
        if not self.resumes_in_place:
            self._client.send_payload(payload)
            return
        self._begin_step_on_device(payload.step_id)
        with self._announce_lock:
            self._announced.append(payload)
            failover = self._failover
            if failover is None:
                try:
                    self._client.send_payload(payload)
                    return
                except AFDConnectionError:
                    failover = self._start_failover()
        failover.wait()
        if self._failover_error is not None:
            raise self._failover_error

    def resuming_at(self, layer: int) -> ResumePlan | None:
        """FFN side: the resume plan if ``layer`` is the first one that a
        replacement's first step runs (``resume``); else None."""
        resume = self._resuming
        return resume if resume is not None and resume.layer == layer else None

    def resumed(self) -> None:
        """FFN side: the resumed layer is answered; the rest runs as usual."""
        self._resuming = None

    def _resumed_step(self, step: ControlPayload) -> ControlPayload:
        """FFN side, a replacement's first step: how it runs (from the plan's
        layer, eager), or an error if it cannot."""
        resume, self._resume = self._resume, None
        problem = None
        if step.num_stages != 1:
            problem = f"step {step.step_id} has {step.num_stages} stages, resuming needs one"
        else:
            problem = resume.check_rows(step.token_counts[0])
        if problem is not None:
            raise AFDConnectionError(f"AFD FFN rank {self.rank} cannot resume: {problem}")
        # Beside the attention ranks' logged positions, this says what a
        # resumed step ran.
        logger.info("AFD FFN rank %d: resumes step %d (rows %s) by %s", self.rank, step.step_id,
                    step.token_counts[0], resume)  # fmt: skip
        if not resume.runs_from_flags:
            return step
        self._resuming = resume
        return dataclasses.replace(step, resumes_at_layer=resume.layer)

    # --------------------------------------------------------- control plane
    def publish_step(self, token_counts: TokenLayout, **flags: bool) -> None:
        """Attention side: announce the next forward to the FFN rank."""
        assert self._client is not None
        payload = ControlPayload(step_id=self._next_step, token_counts=token_counts, **flags)
        self.step_stages = payload.num_stages
        if self.can_fail_over and not self.resumes_in_place:
            self._in_flight = (payload, dataclasses.replace(self.graph_stats), self.tokens_sent)
        self._announce(payload)
        self._next_step += 1
        if payload.is_real:
            self.tokens_sent += sum(stage[self.peer_index] for stage in token_counts)
        self._bound_transfers(payload)
        self.timeline.begin_step(token_counts, self._count_step(payload), payload.is_real)

    def _bound_transfers(self, step: ControlPayload) -> None:
        # The forwards before serving (profiling, warm-ups, captures) may
        # wait for a peer that compiles its model inside them: only the peer's
        # death ends such a wait (its connections closing or, for a vanished
        # host, failing: see control.framing.configure_socket), not its duration.
        self.transfer_timeout_s = self.afd_config.timeout_s if step.is_real else None

    def _count_step(self, payload: ControlPayload) -> StepKind:
        total = sum(map(sum, payload.token_counts))
        if payload.is_graph_capturing:
            kind = StepKind.CAPTURE
            self._captured_totals.add(total)
        elif payload.is_graph_replaying:
            kind = StepKind.REPLAY
        else:
            kind = StepKind.EAGER
            if payload.is_real and total in self._captured_totals:
                self.graph_stats.eager_at_graph_size += 1
        self.graph_stats.count(kind, len(payload.token_counts))
        return kind

    def attention_stats(self) -> dict[str, float]:
        """Attention side: this rank's AFD figures so far, cumulative, as
        vLLM's stats path carries them to its /metrics
        (``ModelRunnerOutput.afd_stats``, ``vllm/afd/attention/metrics.py``)."""
        steps, times = self.graph_stats, self.step_time_totals
        return {
            "capture_steps": float(steps.captures),
            "replay_steps": float(steps.replays),
            "eager_steps": float(steps.eager),
            "tokens": float(self.tokens_sent),
            "timed_steps": float(times.steps),
            "compute_seconds": times.compute_ms / 1000,
            "exchange_seconds": times.exchange_ms / 1000,
            "failovers": float(self.failovers),
            "failover_pause_seconds": self.failover_pause_s,
        }

    def attention_stats_to_report(self) -> dict[str, float]:
        """Attention side: how far each figure of ``attention_stats`` grew
        since the last call, for a step's output to carry. vLLM hands a
        step's stats to one of its API servers only, and each adds up what
        it receives, so every growth is reported once. A failover rolls the
        redone step's figures back; they count again only past where they
        had been."""
        with self._report_lock:
            figures = self.attention_stats()
            reported = self._reported
            self._reported = {f: max(v, reported.get(f, 0.0)) for f, v in figures.items()}
        return {f: max(0.0, v - reported.get(f, 0.0)) for f, v in figures.items()}

    def log_step_stats(self, who: str, graph_stats: GraphStepStats) -> None:
        """At shutdown: how the steps ran and, with ``time_steps``, their times."""
        logger.info(graph_stats.log_line(who))
        self.timeline.finish()
        for line in self.timeline.log_lines(who):
            logger.info(line)

    def next_step(self) -> ControlPayload:
        """FFN side: wait for the next step every peer agrees on."""
        assert self._server is not None
        payloads = self._server.recv_payloads()
        step = merge_peer_payloads(payloads, self._next_step)
        if self._resume is not None:
            step = self._resumed_step(step)
        self.step_stages = step.num_stages
        self._next_step += 1
        self._bound_transfers(step)
        for peer, (rank, payload) in enumerate(zip(self.peer_ranks, payloads, strict=True)):
            if not (payload.is_warmup or payload.is_profile or payload.shutdown):
                self.request_tokens[rank] += sum(stage[peer] for stage in step.token_counts)
        return step

    # ------------------------------------------------------------ data plane
    def _device_facts(self) -> dict[str, Any]:
        """Attention side: what the FFN rank must know about this rank's
        device to join it (sent in the hello)."""
        return {}

    def _record_peer_devices(self, facts: dict[int, dict[str, Any]]) -> list[str]:
        self.peer_devices = facts
        return self._check_peer_devices(facts)

    def _check_peer_devices(self, facts: dict[int, dict[str, Any]]) -> list[str]:
        """FFN side: why the data plane cannot join the peers whose
        ``_device_facts`` these are (by attention rank); empty if it can."""
        return []

    @abstractmethod
    def _serve_data_plane(self) -> dict[str, Any]:
        """FFN side, before the handshake reply: open what the peers join.
        The returned dict reaches every peer's ``_join_data_plane``."""

    @abstractmethod
    def _join_data_plane(self, data_plane: dict[str, Any]) -> None:
        """Both sides, after a successful handshake."""

    @abstractmethod
    def send_hidden_states(self, hidden_states: torch.Tensor, layer: int, stage: int) -> None:
        """Attention side: hand one layer's normed hidden states to the FFN."""

    @abstractmethod
    def recv_ffn_output(self, out: torch.Tensor, layer: int, stage: int) -> None:
        """Attention side: fill ``out`` with the FFN output for that layer."""

    @abstractmethod
    def recv_hidden_states(
        self, layer: int, stage: int, token_counts: tuple[int, ...]
    ) -> list[torch.Tensor]:
        """FFN side: one tensor per peer, ``token_counts[peer]`` rows each."""

    @abstractmethod
    def send_ffn_output(self, outputs: list[torch.Tensor], layer: int, stage: int) -> None:
        """FFN side: send each peer its slice of the FFN output."""

    @abstractmethod
    def _close_data_plane(self) -> None: ...

    def _leave_data_plane(self) -> None:
        """Attention side, the FFN rank lost: let go of what a replacement
        does not join again (by default everything)."""
        self._close_data_plane()

    def ffn_rank_lost_message(self, notice_wait_s: float = 0.0) -> str:
        """Attention side: what to say about a lost FFN rank. It sends a stop
        notice naming the attention rank it lost, if that was why it stopped;
        a transfer may fail a moment before that notice arrives, hence the
        wait."""
        assert self._client is not None
        notice = self._client.stop_notice(notice_wait_s)
        if notice is None:
            why = "its control connection closed: the FFN process exited or crashed, see its log"
        else:
            why = f"the FFN rank stopped the deployment: {notice}"
        where = f"{self.host}:{self.port}"
        return f"AFD attention rank {self.rank}: lost the FFN rank at {where} ({why})"

    def _ffn_rank_lost(self) -> None:
        """Attention side, from the watchdog. This rank may be waiting on the
        FFN rank where no exception reaches. With failover either the
        forward in flight keeps waiting while a replacement is found
        (``resumes_in_place``), or its own transfers fail (gloo: at once,
        or within ``timeout_s`` for a vanished host) and the next forward
        waits for a replacement."""
        if self.can_fail_over and self._client.stop_notice(wait_s=0.5) is None:
            if self.resumes_in_place:
                with self._announce_lock:
                    self._start_failover()
                return
            logger.warning("%s; the next forward waits for a replacement.",
                           self.ffn_rank_lost_message())  # fmt: skip
            return
        logger.error(
            "%s. Stopping this rank; the step in flight is discarded.",
            self.ffn_rank_lost_message(),
        )
        self._ffn_loss_logged = True
        self._stop_model_thread()

    def _attention_ranks_lost(self, ranks: list[int]) -> None:
        """FFN side, from the watchdog: attention peers closed their
        connection without a shutdown message."""
        self.stop_serving(f"attention rank(s) {ranks} disconnected")
        self._stop_model_thread()

    def stop_serving(self, cause: BaseException | str) -> AFDConnectionError:
        """FFN side, once: settle why this rank stops (naming the attention
        ranks it lost, if any), tell the peers still connected, and return
        the error for the caller to raise."""
        assert self._server is not None
        with self._stop_lock:
            if self._stop_reason is None:
                lost = self._server.lost_peers(wait_s=1.0)
                self._stop_reason = (
                    f"attention rank(s) {lost} disconnected without a shutdown message: "
                    "exited or crashed"
                    if lost
                    else f"FFN rank {self.rank} failed: {cause}"
                )
                logger.error(
                    "AFD FFN rank %d: %s. Stopping, and telling attention ranks %s to stop.",
                    self.rank,
                    self._stop_reason,
                    [r for r in self.peer_ranks if r not in lost],
                )
                self._server.stop_peers(self._stop_reason)
        return AFDConnectionError(f"AFD FFN rank {self.rank}: {self._stop_reason}")

    @property
    def stop_reason(self) -> str | None:
        """FFN side: why this rank stops serving, once it does."""
        return self._stop_reason

    def lost_peers(self) -> list[int]:
        """FFN side: the attention peers whose connection closed without a
        shutdown message (none before all have connected)."""
        return self._server.lost_peers(wait_s=0) if self._server is not None else []

    def _stop_model_thread(self) -> None:
        """Release this rank's device waits on the lost peer, raise in the
        thread that runs the model (vLLM then reports the engine dead), and
        exit if that has not ended the process within timeout_s."""
        if self.device_waits:
            self._abort_data_plane()
        raise_in_thread(self._model_thread, AFDPeerLostError)
        time.sleep(self.afd_config.timeout_s)
        logger.error(
            "AFD %s rank %d: still running %.0f s after losing a peer; exiting",
            self.role,
            self.rank,
            self.afd_config.timeout_s,
        )
        os._exit(1)

    def _abort_data_plane(self) -> None:
        """The peer is gone: let this rank's pending device-side waits on it
        finish. Connectors with ``device_waits`` implement it; other
        connectors' transfers fail by themselves."""
        raise NotImplementedError(f"{type(self).__name__} cannot abort its data plane")

    # -------------------------------------------------------------- teardown
    def on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after the connector closes (e.g. reap a spawned FFN)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Attention side: tell the FFN rank to stop. Both: release everything."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._client is not None:
            # First: vLLM may kill this process moments after it starts to shut down.
            try:
                self._client.send_payload(
                    ControlPayload.shutdown_message(self._next_step, self.step_failed)
                )
            except Exception as e:  # the FFN rank may be gone already
                logger.warning("AFD: could not send shutdown to the FFN rank: %s", e)
            # This rank may be shutting down because a data-parallel peer died
            # (vLLM's own collectives may notice it first): if the FFN rank's
            # stop notice naming that peer has arrived, say so.
            if self._client.stop_notice(0) is not None and not self._ffn_loss_logged:
                logger.error("%s.", self.ffn_rank_lost_message())
            self._client.close()
            self.log_step_stats(f"attention rank {self.rank}", self.graph_stats)
        if self._server is not None:
            self._server.close()
        try:
            self._close_data_plane()
        finally:
            for callback in self._on_close:
                callback()
