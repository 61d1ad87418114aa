# SPDX-License-Identifier: Apache-2.0
"""The attention rank's endpoint: it announces every forward to its FFN rank
(one control payload per step), owns its end of the data plane, and, with
``failover_timeout_s``, outlives a lost FFN rank (``afd_transfer.failover``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.distributed.afd_transfer.accounting import AttentionAccounting, new_timeline
from vllm.distributed.afd_transfer.afd_connector.base import ExchangeShape, StepExchange
from vllm.distributed.afd_transfer.auth import load_secret
from vllm.distributed.afd_transfer.control.client import ControlClient
from vllm.distributed.afd_transfer.endpoint.base import AFDEndpoint
from vllm.distributed.afd_transfer.failover import Failover, choose_failover, redo_limits
from vllm.distributed.afd_transfer.payload import ControlPayload, TokenLayout
from vllm.distributed.afd_transfer.watchdog import ControlConnectionWatchdog
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.step_stats import NullTimeline, StepTimeline

logger = init_logger(__name__)


class AttentionEndpoint(AFDEndpoint):
    role = "attention"

    def __init__(
        self,
        vllm_config: VllmConfig,
        rank: int,
        shape: ExchangeShape,
        on_close: Iterable[Callable[[], None]] = (),
        start_replacement: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        """``start_replacement``, with ``spawn_ffn``: starts a new FFN process
        in a lost one's place, returning the check that it still runs
        (``connect``'s ``still_waiting``). Without it a replacement is started
        by hand, or is a standby."""
        exchange = StepExchange(describe_lost_ffn_rank=self.ffn_rank_lost_message)
        super().__init__(vllm_config, rank, shape, exchange, on_close)
        self.client: ControlClient | None = None
        self.accounting = AttentionAccounting(
            self.spec.peer_index,
            new_timeline(self.afd_config.time_steps, self.on_gpu, from_step_start=True),
        )
        self.step_failed = False
        """A step of this worker raised (``afd_step``), so its shutdown
        message tells the FFN rank it did not finish its work."""
        self.ffn_loss_logged = False
        self.failover: Failover = choose_failover(
            self, start_replacement, redo_repeats_the_forward=not redo_limits(vllm_config)
        )

    @property
    def timeline(self) -> StepTimeline | NullTimeline:
        return self.accounting.timeline

    @property
    def alone_as(self) -> int | None:
        """An attention rank of its own (``attention_rank``): its peer index,
        under which it announces its own tokens only; None for a
        data-parallel rank, which announces every peer's."""
        return self.spec.peer_index if self.afd_config.separate_attention_ranks else None

    def connect(self, still_waiting: Callable[[], None] = lambda: None) -> None:
        """Rendezvous and handshake, then join the data plane."""
        client = self.control_client(self.afd_config.startup_timeout_s, "startup_timeout_s")
        welcome = client.connect(self.fingerprint, still_waiting, self.data_plane.device_facts())
        self.use_client(client)
        self.data_plane.join(welcome.data_plane)
        self._connected()

    def control_client(
        self, timeout_s: float, timeout_name: str, replacing: bool = False
    ) -> ControlClient:
        """A client for the FFN rank at `host`; ``replacing`` a lost one, at
        `host` or one of `failover_hosts`."""
        return ControlClient(
            self.host,
            self.port,
            self.rank,
            timeout_s,
            load_secret(self.afd_config.secret_file),
            liveness_s=self.afd_config.timeout_s,
            timeout_name=timeout_name,
            separate=self.afd_config.separate_attention_ranks,
            other_hosts=tuple(self.afd_config.failover_hosts) if replacing else (),
        )

    def use_client(self, client: ControlClient) -> None:
        """Talk to the FFN rank through ``client`` (a replacement's, after a
        failover); the data plane binds to its local address."""
        self.client = client
        self.exchange.local_address = client.socket.getsockname()[0]

    def _watch(self) -> None:
        self._watchdog = ControlConnectionWatchdog(self.client.socket, self._ffn_rank_lost)
        self._watchdog.start()

    def watch_again(self) -> None:
        """After a failover: watch the replacement."""
        self._watch()

    def stop_watching(self) -> None:
        """Before a failover: no loss handling may run past here."""
        self._watchdog.stop(join=True)

    # --------------------------------------------------------- control plane
    def publish_step(self, token_counts: TokenLayout, **flags: bool) -> None:
        """Announce the next forward to the FFN rank."""
        self._publish(ControlPayload(step_id=self._next_step, token_counts=token_counts, **flags))

    def publish_again(self, payload: ControlPayload) -> None:
        """A redo, after ``rewind_to``: announce ``payload``, the step that
        runs again, as it was announced first."""
        assert payload.step_id == self._next_step, (payload.step_id, self._next_step)
        self._publish(payload)

    def _publish(self, payload: ControlPayload) -> None:
        assert self.client is not None
        self.failover.announce(payload)
        self._next_step += 1
        self.accounting.count_step(payload)
        self._bound_transfers(payload)

    def rewind_to(self, step_id: int) -> None:
        """A redo: the next step announced is ``step_id`` again."""
        self._next_step = step_id

    # ------------------------------------------------------------ loss
    def ffn_rank_lost_message(self, notice_wait_s: float = 0.0) -> str:
        """What to say about a lost FFN rank. It sends a stop notice naming
        the attention rank it lost, if that was why it stopped; a transfer
        may fail a moment before that notice arrives, hence the wait."""
        assert self.client is not None
        notice = self.client.stop_notice(notice_wait_s)
        if notice is None:
            why = "its control connection closed: the FFN process exited or crashed, see its log"
        else:
            why = f"the FFN rank stopped the deployment: {notice}"
        return f"AFD attention rank {self.rank}: lost the FFN rank at {self.client.address} ({why})"

    def _ffn_rank_lost(self) -> None:
        """From the watchdog. This rank may be waiting on the FFN rank where
        no exception reaches: unless a failover takes it over, stop."""
        if self.failover.on_loss():
            return
        logger.error(
            "%s. Stopping this rank; the step in flight is discarded.",
            self.ffn_rank_lost_message(),
        )
        self.stop_after_loss()

    def stop_after_loss(self) -> None:
        """The FFN rank is lost for good (the error is logged): stop."""
        self.ffn_loss_logged = True
        self._stop_model_thread()

    # -------------------------------------------------------------- teardown
    def _say_goodbye(self) -> None:
        """Tell the FFN rank to stop."""
        if self.client is None:
            return
        # First: vLLM may kill this process moments after it starts to shut down.
        try:
            self.client.send_payload(
                ControlPayload.shutdown_message(self._next_step, self.step_failed)
            )
        except Exception as e:  # the FFN rank may be gone already
            logger.warning("AFD: could not send shutdown to the FFN rank: %s", e)
        # This rank may be shutting down because a data-parallel peer died
        # (vLLM's own collectives may notice it first): if the FFN rank's
        # stop notice naming that peer has arrived, say so.
        if self.client.stop_notice(0) is not None and not self.ffn_loss_logged:
            logger.error("%s.", self.ffn_rank_lost_message())
        self.client.close()
        self.accounting.log_at_shutdown(f"attention rank {self.rank}", self.afd_config.stats_dir)
