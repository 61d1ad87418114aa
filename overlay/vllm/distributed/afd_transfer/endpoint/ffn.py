# SPDX-License-Identifier: Apache-2.0
"""The FFN rank's endpoint: it serves every attention peer of one FFN rank,
takes one step that all of them agree on at a time, and stops them all,
naming the cause, when it cannot go on. A standby is checked against the
rank it backs before it waits for its port (``prepare_standby``).

Attention ranks that are deployments of their own step apart: each step
serves those that announced one (``PeerPlaces``), and with
``failover_timeout_s`` a lost one is dropped, the others served on, and a
restarted one welcomed back at its place between two steps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.afd_transfer.accounting import FFNAccounting, StepObserver, new_timeline
from vllm.distributed.afd_transfer.afd_connector.base import (
    ExchangeShape,
    InPlaceDataPlane,
    StepExchange,
)
from vllm.distributed.afd_transfer.auth import load_secret
from vllm.distributed.afd_transfer.control.client import ask_served_rank_as_standby
from vllm.distributed.afd_transfer.control.peers import SERVED
from vllm.distributed.afd_transfer.control.server import ControlServer
from vllm.distributed.afd_transfer.endpoint.base import AFDEndpoint
from vllm.distributed.afd_transfer.failover import resumed_step
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.payload import (
    ControlPayload,
    TokenLayout,
    merge_peer_payloads,
)
from vllm.distributed.afd_transfer.watchdog import PeerLossWatchdog
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.resume import ResumePlan
    from vllm.distributed.afd_transfer.step_stats import (
        GraphStepStats,
        NullTimeline,
        StepTimeline,
    )

logger = init_logger(__name__)


class FFNEndpoint(AFDEndpoint):
    role = "ffn"

    def __init__(
        self,
        vllm_config: VllmConfig,
        rank: int,
        shape: ExchangeShape,
        on_close: Iterable[Callable[[], None]] = (),
        layouts_for_standby: Callable[[], list[TokenLayout] | None] = lambda: None,
        step_observers: Iterable[StepObserver] = (),
    ) -> None:
        """``layouts_for_standby``: the token layouts this rank has graphs
        for, once it serves (None before); ``step_observers``: called with
        each real step's compute and exchange milliseconds (with
        ``time_steps``)."""
        exchange = StepExchange(local_address=vllm_config.afd_config.host)
        super().__init__(vllm_config, rank, shape, exchange, on_close)
        self.accounting = FFNAccounting(
            self.spec.peer_ranks,
            new_timeline(self.afd_config.time_steps, self.on_gpu, False, step_observers),
        )
        self._layouts_for_standby = layouts_for_standby
        self._server: ControlServer | None = None
        self.peer_devices: dict[int, dict[str, Any]] = {}
        """Each attention peer's device facts from its hello, by rank."""
        self._stop_reason: str | None = None
        self._stop_lock = threading.Lock()
        self._resume: ResumePlan | None = None
        """A replacement: where to resume, until its first step."""
        self._alone_since: float | None = None
        """Attention ranks of their own: since when none is served (all
        finished or lost)."""

    @property
    def timeline(self) -> StepTimeline | NullTimeline:
        return self.accounting.timeline

    # ---------------------------------------------------------------- set-up
    def connect(self) -> None:
        """Rendezvous with every peer and handshake, then open the data plane."""
        self._server = ControlServer(
            self.host,
            self.port,
            self.peer_ranks,
            self.fingerprint,
            self.afd_config.startup_timeout_s,
            load_secret(self.afd_config.secret_file),
            liveness_s=self.afd_config.timeout_s,
            standby=self.afd_config.standby,
            num_layers=self.spec.num_layers,
            standby_offer=self._standby_offer,
            keep_places=self.keeps_places,
        )
        data_plane = self._server.accept_peers(self.data_plane.serve, self._record_peer_devices)
        if self.serves_others_on:
            self.data_plane.serve_on_after_loss = True
        # A replacement FFN rank resumes the step count of the rank it replaces.
        self._next_step = self._server.resume_step
        self._resume = self._server.resume
        self.data_plane.join(data_plane)
        self._connected()

    def prepare_standby(self, capture_graphs: bool) -> list[TokenLayout]:
        """A standby, before it waits for its port: check it against the FFN
        rank it backs (``ask_served_rank_as_standby``). A data plane whose
        CUDA graphs hold its peers' memory (``InPlaceDataPlane``) then waits
        for that rank to serve, maps the memory it offers, and returns the
        token layouts it serves in graphs, for this standby to capture
        before it takes over; the others return none."""
        secret = load_secret(self.afd_config.secret_file)
        wants_offer = capture_graphs and isinstance(self.data_plane, InPlaceDataPlane)
        waiting = False
        while True:
            answer = ask_served_rank_as_standby(self.host, self.port, self.fingerprint, secret)
            if answer is None:
                return []
            if not wants_offer or answer.offer is not None:
                logger.info("AFD FFN standby: it can take the place of the FFN rank on %s:%d "
                            "(same model, topology, connector and graph mode)",
                            self.host, self.port)  # fmt: skip
                return self.data_plane.prepare_in_advance(answer.offer) if wants_offer else []
            if not waiting:
                waiting = True
                logger.info("AFD FFN standby: waiting for the FFN rank on %s:%d to serve, to "
                            "capture its graphs in advance", self.host, self.port)  # fmt: skip
            time.sleep(1.0)

    def _standby_offer(self) -> dict[str, Any] | None:
        """Serving: what a standby backing this rank prepares its takeover
        with; None while not known yet."""
        if not isinstance(self.data_plane, InPlaceDataPlane):
            return {}
        return self.data_plane.standby_offer(self.peer_devices, self._layouts_for_standby())

    def _record_peer_devices(self, facts: dict[int, dict[str, Any]]) -> list[str]:
        self.peer_devices = facts
        return self.data_plane.check_peer_devices(facts)

    @property
    def keeps_places(self) -> bool:
        """Whether a lost attention rank of its own is dropped and its place
        kept (``failover_timeout_s``, on a data plane that keeps its peers
        apart), rather than stopping this rank."""
        return bool(self.afd_config.failover_timeout_s) and self.data_plane.keeps_peers_apart

    @property
    def serves_others_on(self) -> bool:
        """Whether this rank serves on after losing an attention rank: its
        peers are attention ranks of their own and it keeps places."""
        return self._server is not None and self._server.places is not None and self.keeps_places

    def _watch(self) -> None:
        if self.serves_others_on:
            # Nothing waits on the device (gloo): a lost peer fails its
            # transfer or its control read in the model thread, which drops it.
            return
        self._watchdog = PeerLossWatchdog(self._server.lost_peers, self._attention_ranks_lost)
        self._watchdog.start()

    # --------------------------------------------------------- control plane
    def next_step(self) -> ControlPayload:
        """Wait for the next step every peer agrees on."""
        assert self._server is not None
        if self._server.places is not None:
            return self._next_step_apart()
        payloads = self._server.recv_payloads()
        step = merge_peer_payloads(payloads, self._next_step)
        self.exchange.resuming = None  # a resumed step is over once the next comes
        if self._resume is not None:
            resume, self._resume = self._resume, None
            step = resumed_step(self.rank, resume, step)
            if step.resumes_at_layer is not None:
                self.exchange.resuming = resume
        self._next_step += 1
        self._bound_transfers(step)
        self.accounting.count_step(payloads, step.token_counts)
        return step

    def _next_step_apart(self) -> ControlPayload:
        """Attention ranks of their own: the next step of those that have
        one ready; a shutdown once all have finished. Between steps, drop
        the lost ones and welcome restarted ones back (``keeps_places``)."""
        server, places = self._server, self._server.places
        while True:
            for peer in self.data_plane.take_failed_peers():
                rank = self.peer_ranks[peer]
                if places.state(rank) == SERVED:
                    server.lose_place(rank, "failed a transfer")
                self.data_plane.drop_peer(peer)
            if self.keeps_places:
                plane = self.data_plane
                server.admit_returning(plane.open_place, plane.join_place, plane.drop_peer)
            for rank in server.read_announcements(wait_s=0.05):
                self.data_plane.drop_peer(self.peer_ranks.index(rank))
            ready = places.next_step(self._next_step)
            if ready is not None:
                break
            if places.all_finished():
                return ControlPayload.shutdown_message(self._next_step)
            if not places.served:
                self._wait_for_a_restart(places.lost)
            else:
                self._alone_since = None
        step, payloads = ready
        self._next_step += 1
        self._bound_transfers(step)
        self.accounting.count_step(payloads, step.token_counts)
        return step

    def _wait_for_a_restart(self, lost: list[int]) -> None:
        """No attention rank is served and some were lost: wait up to
        ``failover_timeout_s`` for one to come back, then stop."""
        now = time.monotonic()
        wait_s = self.afd_config.failover_timeout_s
        if self._alone_since is None:
            self._alone_since = now
            logger.warning("AFD FFN rank %d: no attention rank left to serve (lost: %s); waiting "
                           "up to %.0f s for a restarted one", self.rank, lost, wait_s)  # fmt: skip
        elif now - self._alone_since > wait_s:
            logger.error("AFD FFN rank %d: no attention rank came back within %.0f s of the "
                         "last one's end", self.rank, wait_s)  # fmt: skip
            raise self.stop_serving(f"no attention rank came back within {wait_s:.0f} s")

    # ------------------------------------------------------------------ loss
    def _attention_ranks_lost(self, ranks: list[int]) -> None:
        """From the watchdog: attention peers closed their connection
        without a shutdown message."""
        self.stop_serving(f"attention rank(s) {ranks} disconnected")
        self._stop_model_thread()

    def stop_serving(self, cause: BaseException | str) -> AFDConnectionError:
        """Once: settle why this rank stops (naming the attention ranks it
        lost, if any), tell the peers still connected, and return the error
        for the caller to raise."""
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
        """Why this rank stops serving, once it does."""
        return self._stop_reason

    def lost_peers(self) -> list[int]:
        """The attention peers whose connection closed without a shutdown
        message (none before all have connected)."""
        return self._server.lost_peers(wait_s=0) if self._server is not None else []

    # -------------------------------------------------------------- teardown
    def log_at_shutdown(self, graph_stats: GraphStepStats) -> None:
        self.accounting.log_at_shutdown(
            f"FFN rank {self.rank}", graph_stats, self.afd_config.stats_dir
        )

    def _say_goodbye(self) -> None:
        if self._server is not None:
            self._server.close()
