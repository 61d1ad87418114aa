# SPDX-License-Identifier: Apache-2.0
"""Failover: an attention rank outlives its FFN rank (``failover_timeout_s``).

An FFN rank holds no request state and no KV cache, so losing one costs only
the forward it was serving. How that forward is saved depends on where the
data plane's transfers wait:

* on the device, in memory the attention rank owns (``InPlaceDataPlane``,
  ipc): ``InPlaceFailover``. Nothing fails in the attention rank: its
  forward in flight stays blocked on the lost rank while a thread finds a
  replacement, reads from the flags which layer each transfer reached, and
  announces the steps again from there; the replacement runs that step from
  that layer (``resume``; on the FFN side ``resumed_step``). The host never
  waits for the GPU, so failover costs nothing while nothing fails.
* on the host (gloo), where running the forward again repeats it
  exactly: ``RedoFailover``. The forward's transfer fails; the attention
  worker's forward, run by ``vllm.afd.attention.failover``'s redo (Model
  Runner V1's ``_model_forward``, V2's model call), waits for a replacement
  (``replace_ffn_rank``), announces the step to it again and runs again
  with the same inputs. A step whose announcement finds the FFN rank gone
  is announced to its replacement instead (``announce``).
* in NCCL kernels (nccl), whose communicator a lost member leaves waiting
  for good: ``DeviceRedoFailover``, a redo as on gloo. The watchdog aborts
  the communicator (``ncclCommAbort``), which ends the forward in flight
  with rows that never arrived, so each forward is checked once the GPU
  has run it (``check_forward``) and runs again with a replacement's new
  communicator. Every graph captured so far holds the old one: the
  attention rank runs eager from then on (``graphs_usable``), at the
  token counts the graphs were captured for, so its kernels stay those of
  the graphs.
* on the host (gloo), where a second run would not be the same forward
  (``redo_limits``: a recurrent state that each forward updates in place,
  TP ranks that the redo does not reach): ``HostInPlaceFailover``. The
  failed transfer itself waits, in the model thread, for a replacement
  (``resume_after_loss``), which runs the step from this layer, as on ipc;
  the data plane sends it this layer's rows again, and the previous
  layer's where another peer stands a layer behind.

Without ``failover_timeout_s`` (``Failover``) a lost FFN rank ends the rank.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.afd_transfer.afd_connector.base import InPlaceDataPlane
from vllm.distributed.afd_transfer.handshake import AFDConnectionError, AFDPeerGoneError
from vllm.distributed.afd_transfer.payload import ControlPayload
from vllm.distributed.afd_transfer.resume import (
    STEP_MASK,
    PeerPosition,
    ResumePlan,
    position_from_flags,
    position_from_stage_flags,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.afd_transfer.accounting import AttentionCounters
    from vllm.distributed.afd_transfer.control.client import ControlClient, Welcome
    from vllm.distributed.afd_transfer.endpoint.attention import AttentionEndpoint

logger = init_logger(__name__)


def redo_limits(vllm_config: VllmConfig) -> list[str]:
    """Why running an attention rank's forward again would not be the same
    forward: empty where a redo repeats it exactly."""
    limits = []
    model = vllm_config.model_config
    if model is not None and model.is_hybrid:
        limits.append(f"{model.architecture} keeps a recurrent state that each forward "
                      "updates in place, so a second run would apply its step twice")  # fmt: skip
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1:
        limits.append(f"its {tp} tensor-parallel ranks wait in collectives that a redo on "
                      "the rank that exchanges with the FFN rank does not reach")  # fmt: skip
    return limits


def choose_failover(
    endpoint: AttentionEndpoint,
    start_replacement: Callable[[], Callable[[], None]] | None,
    redo_repeats_the_forward: bool,
) -> Failover:
    """The failover an attention rank's configuration and data plane call for."""
    if endpoint.afd_config.failover_timeout_s <= 0:
        return Failover(endpoint)
    if isinstance(endpoint.data_plane, InPlaceDataPlane):
        return InPlaceFailover(endpoint, start_replacement)
    if endpoint.data_plane.device_waits:
        # verify_afd_failover refuses these where a redo is not the same forward
        assert redo_repeats_the_forward, "a device-waiting data plane fails over by a redo"
        return DeviceRedoFailover(endpoint, start_replacement)
    if not redo_repeats_the_forward:
        return HostInPlaceFailover(endpoint, start_replacement)
    return RedoFailover(endpoint, start_replacement)


class Failover:
    """No failover: announce each step; a lost FFN rank ends this rank."""

    def __init__(self, endpoint: AttentionEndpoint) -> None:
        self.endpoint = endpoint

    def announce(self, payload: ControlPayload) -> None:
        self.endpoint.client.send_payload(payload)

    def on_loss(self) -> bool:
        """From the watchdog, the FFN rank lost: whether this failover takes
        it over (else the rank stops)."""
        return False

    @property
    def graphs_usable(self) -> bool:
        """Whether the attention rank may replay the graphs it captured."""
        return True

    def check_forward(self) -> None:
        """In the model thread, after a forward that a redo covers: raise
        ``AFDConnectionError`` where the FFN rank was lost without failing
        the forward itself (``DeviceRedoFailover``)."""


class _Replacing(Failover):
    """What both failovers do: wait for an FFN rank in the lost one's place."""

    def __init__(
        self,
        endpoint: AttentionEndpoint,
        start_replacement: Callable[[], Callable[[], None]] | None,
    ) -> None:
        super().__init__(endpoint)
        self._start_replacement = start_replacement

    def _lost_on_purpose(self) -> bool:
        """The FFN rank stopped the deployment (its stop notice came)."""
        return self.endpoint.client.stop_notice(wait_s=0.5) is not None

    def _warn_waiting(self, what_for: str) -> None:
        logger.warning(
            "%s. Keeping this rank's requests and KV cache: waiting up to %.0f s for an FFN "
            "rank in its place, %s.",
            self.endpoint.ffn_rank_lost_message(),
            self.endpoint.afd_config.failover_timeout_s,
            what_for,
        )

    def _connect_replacement(
        self, cause: object, lost_at: float, in_place: bool, **hello: Any
    ) -> tuple[ControlClient, Welcome]:
        """Let go of the lost FFN rank, start a replacement where this rank
        starts them, and handshake with whichever FFN rank takes the place
        within ``failover_timeout_s`` (``hello``: ``ControlClient.connect``'s
        resume arguments). Returns the new client and its welcome."""
        endpoint = self.endpoint
        endpoint.stop_watching()
        endpoint.client.close()
        # A respawn ends the lost process first: nothing of it may write to
        # this rank's data plane once a replacement uses it.
        start = self._start_replacement
        still_waiting = start() if start else lambda: None
        if not in_place:
            endpoint.data_plane.leave()
        deadline = lost_at + endpoint.afd_config.failover_timeout_s
        facts = endpoint.data_plane.device_facts()
        while True:
            client = endpoint.control_client(
                max(0.1, deadline - time.monotonic()), "failover_timeout_s", replacing=True
            )
            try:
                return client, client.connect(endpoint.fingerprint, still_waiting, facts, **hello)
            except AFDPeerGoneError as e:
                if time.monotonic() >= deadline:
                    raise self._no_replacement_error(cause, e) from e
                # A replacement that dies while it starts is itself replaced.
                logger.warning("AFD attention rank %d: %s; waiting for another", endpoint.rank, e)
                if start:
                    still_waiting = start()
            except AFDConnectionError as e:
                raise self._no_replacement_error(cause, e) from e

    def _announce_again(
        self, client: ControlClient, announced: Iterable[ControlPayload], resume_step: int
    ) -> None:
        """Announce to a replacement that resumes at ``resume_step`` the kept
        steps from there on; raises if this rank no longer keeps that step."""
        again = [p for p in announced if p.step_id >= resume_step]
        if not again or again[0].step_id != resume_step:
            raise AFDConnectionError(
                f"AFD attention rank {self.endpoint.rank}: the replacement resumes at step "
                f"{resume_step}, which this rank no longer keeps "
                f"(it keeps {[p.step_id for p in announced]})"
            )
        for payload in again:
            client.send_payload(payload)

    def _count_failover(self, lost_at: float, then: str) -> None:
        accounting = self.endpoint.accounting
        paused_s = time.monotonic() - lost_at
        accounting.count_failover(paused_s)
        logger.warning(
            "AFD attention rank %d: an FFN rank took the lost one's place after %.1f s "
            "(failover %d); %s",
            self.endpoint.rank,
            paused_s,
            accounting.failovers,
            then,
        )

    def _no_replacement_error(self, cause: object, last: AFDConnectionError):
        e = self.endpoint
        return AFDConnectionError(
            f"AFD attention rank {e.rank}: lost the FFN rank at {e.client.address} "
            f"({cause}), and no FFN rank took its place within "
            f"{e.afd_config.failover_timeout_s:.0f} s: {last}"
        )


class RedoFailover(_Replacing):
    """Transfers fail on the host: the forward in flight fails, and runs
    again once a replacement has joined (``replace_ffn_rank``)."""

    def __init__(self, endpoint, start_replacement) -> None:
        super().__init__(endpoint, start_replacement)
        self._in_flight: tuple[ControlPayload, AttentionCounters] | None = None
        """The step announced last, which a replacement runs again if the FFN
        rank is lost in it, and the counters from before it was announced."""
        self._lost_at: float | None = None
        """When the FFN rank was lost, until the step it was lost in has run
        again (``check_forward``)."""

    def announce(self, payload: ControlPayload) -> None:
        self._in_flight = (payload, self.endpoint.accounting.snapshot())
        while True:
            self._before_sending(payload)
            try:
                super().announce(payload)
                return
            except AFDConnectionError as lost:
                # Lost before this step reached it: nothing of the step has
                # run, and its replacement takes it as its first.
                self.replace_ffn_rank(lost)

    def _before_sending(self, payload: ControlPayload) -> None:
        """Before each try to announce ``payload`` (the step in flight)."""

    def announce_again(self) -> None:
        """After ``replace_ffn_rank``, for a forward announced before the part
        of it that runs again (Model Runner V2's eager forward): announce
        the step in flight to the replacement, as it was announced first."""
        assert self._in_flight is not None
        self.endpoint.publish_again(self._in_flight[0])

    def on_loss(self) -> bool:
        # The forward's own transfers fail (gloo: at once, or within
        # timeout_s for a vanished host); the next forward waits.
        if self._lost_on_purpose():
            return False
        logger.warning("%s; the next forward waits for a replacement.",
                       self.endpoint.ffn_rank_lost_message())  # fmt: skip
        return True

    def replace_ffn_rank(self, cause: AFDConnectionError) -> None:
        """The FFN rank was lost during the step announced last (``cause``
        says how). Connect to the FFN rank that takes its place, and rewind
        to that step, which the caller runs again. Re-raises ``cause`` if
        the FFN rank stopped the deployment on purpose; raises an error
        naming the lost rank if no replacement comes within
        ``failover_timeout_s``."""
        if self._in_flight is None or self._lost_on_purpose():
            raise cause
        step, counters = self._in_flight
        lost_at = self._lost_at = self._lost_at or time.monotonic()
        self._warn_waiting(f"to run step {step.step_id} again")
        client, welcome = self._connect_replacement(
            cause, lost_at, in_place=False, resume_step=step.step_id
        )
        endpoint = self.endpoint
        endpoint.use_client(client)
        endpoint.data_plane.join(welcome.data_plane)
        self._joined()
        endpoint.watch_again()
        endpoint.rewind_to(step.step_id)
        endpoint.accounting.roll_back(counters)
        self._count_failover(lost_at, f"running step {step.step_id} again")

    def check_forward(self) -> None:
        if self._lost_at is not None:
            # The first forward to pass after a loss: its step has run again.
            logger.warning("AFD attention rank %d: step %d ran again %.1f s after the FFN rank "
                           "was lost.", self.endpoint.rank, self._in_flight[0].step_id,
                           time.monotonic() - self._lost_at)  # fmt: skip
            self._lost_at = None

    def _joined(self) -> None:
        """A replacement's data plane is joined, before it is watched."""


class GraphsLostError(Exception):
    """A forward was about to replay a CUDA graph that holds a lost FFN
    rank's NCCL communicator; nothing of it was announced. The runner's
    redo runs it eager instead (``vllm.afd.attention.failover``)."""


class DeviceRedoFailover(RedoFailover):
    """Transfers wait in NCCL kernels, which a lost FFN rank leaves waiting
    and no error reaches: the watchdog aborts the communicator, the forward
    in flight then ends on the GPU with rows that never came, and the model
    thread, which checks every forward once the GPU has run it
    (``check_forward``), runs it again with the replacement. The graphs
    captured so far hold the aborted communicator: from the first loss on,
    none is replayed (``graphs_usable``)."""

    def __init__(self, endpoint, start_replacement) -> None:
        super().__init__(endpoint, start_replacement)
        self._lost = threading.Event()
        """Set by the watchdog, before the abort, until a replacement joins."""
        self._graphs_lost = False

    @property
    def graphs_usable(self) -> bool:
        return not (self._graphs_lost or self._lost.is_set())

    def on_loss(self) -> bool:
        if self._lost_on_purpose():
            return False
        # First the flag, then the abort: a forward that the abort ends finds
        # the flag set when its check runs.
        self._lost_at = time.monotonic()
        self._lost.set()
        self.endpoint.data_plane.abort()
        logger.warning("%s; aborted its NCCL communicator: the forward in flight runs again "
                       "with a replacement.", self.endpoint.ffn_rank_lost_message())  # fmt: skip
        return True

    def _before_sending(self, payload: ControlPayload) -> None:
        if self._lost.is_set():  # lost before this step: it goes to the replacement
            self.replace_ffn_rank(AFDConnectionError(self.endpoint.ffn_rank_lost_message()))
        if payload.is_graph_replaying and not self.graphs_usable:
            raise GraphsLostError(f"step {payload.step_id}")

    def check_forward(self) -> None:
        if not self._lost.is_set():
            self._wait_for_the_gpu()
        if self._lost.is_set():
            raise AFDConnectionError(self.endpoint.ffn_rank_lost_message())
        super().check_forward()

    @staticmethod
    def _wait_for_the_gpu() -> None:
        """Until the forward queued has run. The abort ends every NCCL kernel
        waiting on a lost rank, so this returns whether or not its rows came.
        It costs the overlap of the host's next step with this forward."""
        torch.cuda.current_stream().synchronize()

    def _joined(self) -> None:
        self._lost.clear()
        if not self._graphs_lost:
            self._graphs_lost = True
            logger.warning("AFD attention rank %d: from now on it replays none of the CUDA "
                           "graphs it captured, which hold the lost FFN rank's NCCL "
                           "communicator, and runs their steps eager.",
                           self.endpoint.rank)  # fmt: skip


class HostInPlaceFailover(_Replacing):
    """Transfers fail on the host, and the forward in flight must not run
    twice: the failed transfer waits for a replacement in the model thread
    (``resume_after_loss``, which the data plane calls), and goes on from
    there."""

    def __init__(self, endpoint, start_replacement) -> None:
        super().__init__(endpoint, start_replacement)
        self._announced: collections.deque[ControlPayload] = collections.deque(maxlen=2)
        """The step in flight and the one before: a replacement may resume
        at the last layer of the one before, where another peer stands."""
        endpoint.exchange.resume_after_loss = self.resume_after_loss

    def announce(self, payload: ControlPayload) -> None:
        self._announced.append(payload)
        try:
            self.endpoint.client.send_payload(payload)
        except AFDConnectionError:
            # Lost before this step reached it: the previous step's layers
            # are all answered, so this rank stands at this step's start.
            start = self._resume(PeerPosition(payload.step_id, 0))
            self.endpoint.data_plane.send_kept_again(start)

    def on_loss(self) -> bool:
        # As with the redo: the model thread's next transfer fails.
        if self._lost_on_purpose():
            return False
        logger.warning("%s; the forward in flight waits for a replacement at its next "
                       "transfer.", self.endpoint.ffn_rank_lost_message())  # fmt: skip
        return True

    def resume_after_loss(self, step_id: int, layer: int) -> PeerPosition:
        """From the data plane, in the model thread: a transfer of ``layer``
        in step ``step_id`` failed. Returns, once a replacement has joined,
        where it resumes: here, or a layer behind where another peer
        stands (whose rows of that layer the data plane sends again)."""
        return self._resume(PeerPosition(step_id, layer))

    def _resume(self, position: PeerPosition) -> PeerPosition:
        endpoint, lost_at = self.endpoint, time.monotonic()
        if self._lost_on_purpose():
            raise AFDConnectionError(endpoint.ffn_rank_lost_message())
        self._warn_waiting(f"to answer step {position.step} from layer {position.layer}")
        client, welcome = self._connect_replacement(
            endpoint.ffn_rank_lost_message(), lost_at, in_place=False, position=lambda: position
        )
        endpoint.use_client(client)
        endpoint.data_plane.join(welcome.data_plane)
        start = PeerPosition(welcome.data_plane["resume_step"], welcome.data_plane["resume_layer"])
        self._announce_again(client, self._announced, start.step)
        endpoint.watch_again()
        self._count_failover(lost_at, f"it resumes at step {start.step}, layer {start.layer}")
        return start


class InPlaceFailover(_Replacing):
    """Transfers wait on the device in memory this rank owns: the forward in
    flight stays blocked where the FFN rank was lost, and a replacement
    answers it from there."""

    def __init__(self, endpoint, start_replacement) -> None:
        super().__init__(endpoint, start_replacement)
        self._data_plane: InPlaceDataPlane = endpoint.data_plane
        self._announced: collections.deque[ControlPayload] = collections.deque(maxlen=16)
        """The steps announced last, which a replacement may need again (the
        GPU runs a step or two behind the host)."""
        self._lock = threading.Lock()
        self._failover: threading.Event | None = None
        """Set while a failover runs; the event is set when it ends."""
        self._error: AFDConnectionError | None = None
        """Why the failover failed, once it has."""

    def announce(self, payload: ControlPayload) -> None:
        """A lost FFN rank does not fail the step: the step waits for the
        failover, which announces it to the replacement."""
        self._data_plane.begin_step_on_device(payload.step_id)
        with self._lock:
            self._announced.append(payload)
            failover = self._failover
            if failover is None:
                try:
                    self.endpoint.client.send_payload(payload)
                    return
                except AFDConnectionError:
                    failover = self._start()
        failover.wait()
        if self._error is not None:
            raise self._error

    def on_loss(self) -> bool:
        if self._lost_on_purpose():
            return False
        with self._lock:
            self._start()
        return True

    def _start(self) -> threading.Event:
        """Under ``_lock``: the failover, started once; its event is set when
        it ends."""
        if self._failover is None:
            self._failover = threading.Event()
            threading.Thread(target=self._fail_over, name="afd-failover", daemon=True).start()
        return self._failover

    def _fail_over(self) -> None:
        """In a thread of its own: the GPU keeps this rank's forward in flight
        blocked on the lost FFN rank, and the model thread may wait on the
        GPU. Hand a replacement this rank's position, announce again the
        steps it resumes from, and let the GPU go on; or, with none in time,
        end as without failover."""
        endpoint, lost_at, failover = self.endpoint, time.monotonic(), self._failover
        self._data_plane.end_lost_rank_waits()
        try:
            if self._lost_on_purpose():
                raise AFDConnectionError(endpoint.ffn_rank_lost_message())
            self._warn_waiting("to answer the forward in flight where it stands")
            cause = endpoint.ffn_rank_lost_message()
            client, welcome = self._connect_replacement(
                cause, lost_at, in_place=True, position=self._exchange_position
            )
            endpoint.data_plane.join(welcome.data_plane)
            resume_step = welcome.data_plane["resume_step"]
            with self._lock:
                self._announce_again(client, self._announced, resume_step)
                endpoint.use_client(client)
                endpoint.watch_again()
                self._count_failover(lost_at, f"it resumes at step {resume_step}")
                self._failover = None
            failover.set()
        except AFDConnectionError as e:
            self._error = e
            failover.set()
            logger.error("%s. Stopping this rank.", e)
            endpoint.stop_after_loss()

    def _exchange_position(self) -> PeerPosition:
        """Where this rank's forward in flight stands, read from its data
        plane once nothing of the lost FFN rank writes there. Raises
        ``AFDConnectionError`` if it cannot tell."""
        endpoint = self.endpoint
        timeout_s = endpoint.afd_config.timeout_s
        deadline = time.monotonic() + timeout_s
        while (words := self._data_plane.exchange_words()) is None:
            if time.monotonic() > deadline:
                raise AFDConnectionError(
                    f"AFD attention rank {endpoint.rank}: its GPU did not finish starting a "
                    f"forward within {timeout_s:.0f} s, so where its exchange stands cannot "
                    "be read"
                )
            time.sleep(0.01)
        word, to_ffn, to_attention = words
        with self._lock:
            kept = list(self._announced)
        step = next((p for p in reversed(kept) if p.step_id & STEP_MASK == word), None)
        if step is None:
            raise AFDConnectionError(
                f"AFD attention rank {endpoint.rank}: its GPU is in a step (low bits {word}) "
                f"that this rank no longer keeps (it keeps {[p.step_id for p in kept]})"
            )
        sends = [stage[endpoint.spec.peer_index] > 0 for stage in step.token_counts]
        if not any(sends):
            position = PeerPosition(step.step_id + 1, 0)  # its layers exchange nothing
        elif len(sends) > 1:
            position = position_from_stage_flags(
                step.step_id, to_ffn, to_attention, endpoint.spec.num_layers, sends
            )
        else:
            position = position_from_flags(
                step.step_id, to_ffn, to_attention, endpoint.spec.num_layers
            )
        logger.info("AFD attention rank %d: the forward in flight stands at %s (flags by slot: "
                    "to the FFN rank %s, back %s)", endpoint.rank, position,
                    [hex(w) for w in to_ffn], [hex(w) for w in to_attention])  # fmt: skip
        return position


def resumed_step(ffn_rank: int, resume: ResumePlan, step: ControlPayload) -> ControlPayload:
    """FFN side, a replacement's first step: how it runs (from the plan's
    layer, eager), or an error if it cannot."""
    problem = _why_it_cannot_resume(resume, step)
    if problem is not None:
        raise AFDConnectionError(f"AFD FFN rank {ffn_rank} cannot resume: {problem}")
    # Beside the attention ranks' logged positions, this says what a
    # resumed step ran.
    logger.info("AFD FFN rank %d: resumes step %d (rows by stage %s) by %s", ffn_rank,
                step.step_id, step.token_counts, resume)  # fmt: skip
    if not resume.runs_from_flags:
        return step
    stages = tuple(p.layer for p in resume.stages) or None
    return dataclasses.replace(step, resumes_at_layer=resume.layer, resumes_stages_at=stages)


def _why_it_cannot_resume(resume: ResumePlan, step: ControlPayload) -> str | None:
    if not resume.runs_from_flags:
        return None  # the step runs from its start, however many stages it has
    staged = step.num_stages > 1
    if len(resume.stages) != (step.num_stages if staged else 0):
        if staged:
            return (f"step {step.step_id} has {step.num_stages} stages; a micro-batched step "
                    "resumes only where the FFN rank serves one attention rank, whose "
                    f"position names each stage (plan: {resume})")  # fmt: skip
        return f"step {step.step_id} has one stage, but the position names {resume.stages}"
    return None if staged else resume.check_rows(step.token_counts[0])
