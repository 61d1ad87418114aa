# SPDX-License-Identifier: Apache-2.0
"""Configuration of Attention-FFN Disaggregation (AFD).

With AFD each decoder layer is split between two kinds of process: attention
ranks (normal vLLM engines with scheduler, KV cache and sampler) and FFN ranks
(no scheduler, no KV cache) that run the MLP / MoE part of every layer.
``AFDConfig`` is the one place where a deployment describes that split; it is
reachable as ``VllmConfig.afd_config``, ``EngineArgs.afd_config``,
``--afd-config '{json}'`` and ``LLM(afd_config={...})``.
"""

from __future__ import annotations

import hashlib
from dataclasses import field, fields
from typing import TYPE_CHECKING, Any, Literal

from pydantic import model_validator
from pydantic_core import ArgsKwargs
from vllm.config.utils import config

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

AFDRole = Literal["attention", "ffn"]
AFDMPSMode = Literal["detect", "start", "off"]
AFDIpcSignal = Literal["auto", "stream", "kernel"]


@config
class AFDConfig:
    """Configuration for Attention-FFN Disaggregation."""

    role: AFDRole = "attention"
    """Which half of each decoder layer this process runs: "attention" (a
    normal vLLM engine that sends hidden states to the FFN ranks) or "ffn" (a
    daemon that runs the MLP / MoE of every layer for its attention peers)."""

    connector: str = "gloo"
    """Transport between the roles, one of the connectors registered in
    ``AFDConnectorFactory``: "gloo" (CPU tensors), "ipc" (CUDA IPC buffers,
    both roles on the GPUs of one node, including one shared GPU) or "nccl"
    (NCCL point-to-point, one GPU per rank)."""

    host: str = "127.0.0.1"
    """Address the rendezvous listens on and the peers connect to. Only this
    address is bound; the default keeps AFD on the loopback interface. Any
    other address needs a shared secret (`secret_file`)."""

    secret_file: str | None = None
    """File holding the deployment's shared secret (any bytes; surrounding
    white space is stripped), the same on every rank. Every control
    connection starts with a mutual HMAC-SHA256 proof of it, before the FFN
    rank parses anything else from the peer, and only peers that passed it
    learn the data plane's rendezvous. Without it the secret comes from the
    VLLM_AFD_SECRET environment variable (containers); a non-loopback `host`
    without either is refused at start-up."""

    port: int = 29650
    """TCP port of the rendezvous on `host`."""

    num_attention_ranks: int = 1
    """Number of attention ranks A (the data-parallel ranks of the attention
    deployment)."""

    attention_rank: int | None = None
    """Attention side: run this engine as attention rank r (0 <= r <
    num_attention_ranks) in a deployment of its own (data_parallel_size 1),
    instead of as one data-parallel rank of a deployment of A ranks. Such
    ranks step independently: their FFN rank serves whichever of them have
    a step ready, in one FFN call per layer, and, with failover_timeout_s on
    the FFN rank, the loss of one ends none of the others and a restarted
    one takes its place back. gloo connector. None (default): the attention
    ranks are the data-parallel ranks of one deployment, stepping in
    lockstep, and each one's rank is its data-parallel rank."""

    num_ffn_ranks: int = 1
    """Number of FFN ranks F. A must be a multiple of F: attention rank a talks
    to FFN rank a // (A / F)."""

    ffn_tensor_parallel_size: int = 1
    """Processes (GPUs) per FFN rank. Above 1 the FFN rank is a group that
    splits each layer's FFN with vLLM's tensor parallelism: a dense MLP by
    rows and columns, MoE experts by their intermediate size (or whole experts
    with `ffn_enable_expert_parallel`). Both roles state it; the attention
    side's tensor parallelism is its own `--tensor-parallel-size`."""

    ffn_enable_expert_parallel: bool = False
    """MoE models: give each process of an FFN rank group a share of the
    experts (vLLM's expert parallelism over the group) instead of a slice of
    every expert."""

    compute_gate_on_attention: bool = False
    """For MoE models: compute the router logits on the attention side and send
    them with the hidden states. When false the FFN side computes them."""

    spawn_ffn: bool = False
    """Attention side only: start the local FFN ranks as child processes, so
    that one command runs both roles on one node."""

    ffn_first_device: int | None = None
    """FFN side, on GPUs: the visible GPU that the FFN ranks' first process
    takes; process t of FFN rank f takes the one ``f *
    ffn_tensor_parallel_size + t`` places after it, wrapping around the
    visible GPUs. Default: num_attention_ranks, the GPU after one per
    attention rank, so that on a node with fewer GPUs than processes the
    FFN processes share the GPUs of the attention ranks' other TP ranks
    first. `spawn_ffn` sets it to the first GPU after all the attention
    ranks' GPUs (num_attention_ranks x their tensor-parallel size) when the
    node has one for every process of both roles; set it so by hand next to
    tensor-parallel attention ranks."""

    timeout_s: float = 60.0
    """Upper bound, in seconds, on each wait for a peer once the deployment
    serves (each transfer of a real step), and about how long a peer's host
    may stop answering on the control connection (TCP keepalive) before the
    peer counts as lost, at any time. A peer that does not answer in time is
    reported instead of hanging. The profiling, warm-up and graph-capture
    forwards before serving wait for a peer as long as it lives: it may be
    compiling its model inside them, for minutes on a large model or a
    small CPU; its process ending, or its host vanishing, ends the wait."""

    startup_timeout_s: float = 600.0
    """Upper bound, in seconds, on the waits for a peer to join: the
    rendezvous and handshake (a peer may still be loading its weights, or
    start later on another node) and the data plane's assembly."""

    failover_timeout_s: float = 0.0
    """Attention side: how long, in seconds, to wait for a replacement when
    the FFN rank is lost (its process or host dies). 0 (default): losing it
    ends the deployment. Above 0 the attention rank keeps its requests and KV
    cache, waits this long for an FFN rank to take the lost one's place on
    its host and port (a respawn with `spawn_ffn`, a hand-started `vllm
    afd-ffn`, or a `standby`), checks it at the handshake like the first,
    and runs the forward that was in flight again. A rank that stopped the
    deployment on purpose (it lost another attention rank) is not replaced.
    CPU (gloo connector), attention ranks of one process (no tensor
    parallelism), models whose layers keep no recurrent state.

    FFN side, when its attention ranks are deployments of their own
    (`attention_rank`): above 0, losing one of them (its process or host
    dies, a transfer fails) drops it and the FFN rank goes on serving the
    others, keeping the lost rank's place for a restarted one, which joins
    through the same handshake; once none of its peers is left, the FFN
    rank waits this long for one to come back before it ends. 0: losing one
    stops the FFN rank and every peer, naming the lost rank."""

    failover_hosts: list[str] = field(default_factory=list)
    """Attention side, with `failover_timeout_s`: more hosts where an FFN
    rank may take a lost one's place, on the lost rank's port. After a loss
    the attention rank tries `host`, then each of these, in turn, until an
    FFN rank answers; a name is looked up again at every try, so a DNS name
    moved to the replacement works as a virtual IP does. Empty (default):
    the replacement comes at `host`."""

    standby: bool = False
    """FFN side: load the weights, then wait for the FFN rank's host and port
    to free up (its FFN rank has died) and take its place, so attention ranks
    with `failover_timeout_s` resume without waiting for a load. Start it
    once the deployment serves: a standby started first takes the place of
    the FFN rank it was meant to back."""

    mps: AFDMPSMode = "detect"
    """NVIDIA MPS for the processes of this deployment that share a GPU (the
    roles on one GPU, an FFN rank beside an attention rank, FFN group
    processes on fewer GPUs than processes): without it each exchange
    between them waits for the GPU to switch contexts. "detect": log their
    MPS state, and warn with the fix when they share a GPU without MPS.
    "start": this process starts a private MPS control daemon (its own pipe
    and log directories, under the temporary directory) before any CUDA
    context of the deployment exists; the processes it starts join it, and
    it stops when this process ends, also after a crash or a kill. "off":
    no check."""

    mps_active_thread_percentage: dict[AFDRole, int] = field(default_factory=dict)
    """Under MPS, the share of the GPU's SMs (percent, 1-100) that each
    role's processes may use, e.g. ``{"attention": 40, "ffn": 60}``: each
    process of a named role sets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` before
    its CUDA context exists, and one of a role left out clears it (all SMs).
    Empty (default): AFD leaves that variable alone. Without MPS the driver
    ignores it. Whether a split pays on one GPU: docs/performance.md."""

    ipc_signal: AFDIpcSignal = "auto"
    """Attention side, ipc connector: how a transfer tells the peer that its
    rows are there (the FFN rank follows). "stream": stream memory
    operations on flags in shared host memory; a waiting stream holds no
    SM. "kernel": the flag kernels, a copy that raises a flag in device
    memory and a one-block kernel that spins until it is raised; under MPS
    they take the exchange from 16 to 9 us per layer round trip on an H200
    (docs/performance.md). Without MPS a spin holds the GPU until its time
    slice ends, so "kernel" needs MPS: an attention rank that is not an MPS
    client refuses it. "auto": "kernel" where the attention rank is an MPS
    client, else "stream"."""

    metrics_port: int | None = None
    """FFN side: serve ``/health`` (200 while the rank serves all its
    attention peers, else 503 with the reason) and ``/metrics`` (Prometheus
    text) over HTTP on `host`, FFN rank f on port ``metrics_port + f``. None:
    no endpoints. (The attention side's are vLLM's own API server's.)"""

    time_steps: bool = False
    """Benchmarks: split each real step of both roles into its own compute and
    its exchange (CUDA events on GPUs), logged per token layout at shutdown.
    Reading the events costs a host wait at every step start, so leave it off
    when serving."""

    stats_dir: str | None = None
    """Tools and tests: a directory where each rank writes, at shutdown, a
    JSON record of its step counters and, with ``time_steps``, its step
    times (``attention-rank-N.json``, ``ffn-rank-N.json``; read with
    ``vllm.distributed.afd_transfer.step_stats.StepRecord.read``). None
    writes nothing."""

    connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Connector-specific options, passed to the connector unchanged."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        # pydantic alone says "Unexpected keyword argument"; name the valid keys.
        values = data.kwargs if isinstance(data, ArgsKwargs) else data
        if isinstance(values, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(
                    f"unknown AFD config key(s) {unknown}; valid keys are {sorted(known)}"
                )
        return data

    def __post_init__(self) -> None:
        # role is checked by pydantic against its Literal.
        from vllm.distributed.afd_transfer.afd_connector.factory import AFDConnectorFactory

        if self.connector not in AFDConnectorFactory.names():
            raise ValueError(
                f"unknown AFD connector {self.connector!r}; available: "
                f"{AFDConnectorFactory.names()}"
            )
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= 65535:
                raise ValueError(f"AFD {name} {value} is out of range; use a TCP port in 1..65535")
        if not self.host:
            raise ValueError("AFD host must not be empty (default: 127.0.0.1)")
        from vllm.distributed.afd_transfer.auth import SECRET_VARIABLE, is_loopback, load_secret

        if not all(self.failover_hosts):
            raise ValueError(f"AFD failover_hosts {self.failover_hosts} has an empty host")
        routable = [h for h in (self.host, *self.failover_hosts) if not is_loopback(h)]
        if not load_secret(self.secret_file) and routable:
            raise ValueError(
                f"AFD host {routable[0]!r} is not a loopback address: any process that reaches "
                "it could join this deployment. Give every rank the same shared secret: "
                f'"secret_file": PATH in the AFD config (a file only the deployment can read, '
                f"e.g. made with `head -c 32 /dev/urandom | base64 > PATH; chmod 600 PATH`), "
                f"or the {SECRET_VARIABLE} environment variable"
            )
        a, f = self.num_attention_ranks, self.num_ffn_ranks
        if a < 1 or f < 1:
            raise ValueError(
                f"AFD needs at least one rank of each role, got "
                f"num_attention_ranks={a}, num_ffn_ranks={f}"
            )
        if a < f or a % f != 0:
            raise ValueError(
                f"AFD topology {a}A:{f}F is invalid: num_attention_ranks must "
                f"be a multiple of num_ffn_ranks (A >= F and A % F == 0)"
            )
        if self.ffn_tensor_parallel_size < 1:
            raise ValueError(
                "AFD ffn_tensor_parallel_size must be at least 1, got "
                f"{self.ffn_tensor_parallel_size}"
            )
        if self.ffn_enable_expert_parallel and self.ffn_tensor_parallel_size == 1:
            raise ValueError(
                "ffn_enable_expert_parallel shares the experts among the processes of an "
                "FFN rank: set ffn_tensor_parallel_size to 2 or more"
            )
        if self.ffn_first_device is not None and self.ffn_first_device < 0:
            raise ValueError(
                f"AFD ffn_first_device must be a visible GPU index (0 or more), got "
                f"{self.ffn_first_device}"
            )
        for name in ("timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AFD {name} must be positive, got {getattr(self, name)}")
        if self.failover_timeout_s < 0:
            raise ValueError(
                f"AFD failover_timeout_s must be 0 (no failover) or positive, got "
                f"{self.failover_timeout_s}"
            )
        if self.failover_hosts and not self.failover_timeout_s:
            raise ValueError(
                "AFD failover_hosts are where a replacement for a lost FFN rank may listen: "
                "set failover_timeout_s above 0 with them, or leave them out"
            )
        if self.standby and self.role != "ffn":
            raise ValueError(
                "standby is an FFN-side option (a `vllm afd-ffn` that waits to replace a "
                "lost FFN rank); on the attention side set failover_timeout_s"
            )
        for role, percent in self.mps_active_thread_percentage.items():
            if role not in ("attention", "ffn") or not 1 <= percent <= 100:
                raise ValueError(
                    f"AFD mps_active_thread_percentage {self.mps_active_thread_percentage} "
                    'is not valid: give "attention" and/or "ffn", each a percentage of the '
                    'GPU\'s SMs in 1..100, e.g. {"attention": 40, "ffn": 60}'
                )
        if self.ipc_signal != "auto" and self.connector != "ipc":
            raise ValueError(
                f'AFD ipc_signal "{self.ipc_signal}" applies to the ipc connector only, '
                f'not to "{self.connector}"; leave it out'
            )
        if self.attention_rank is not None:
            if self.role != "attention":
                raise ValueError(
                    "attention_rank is an attention-side option (an engine that is one "
                    "attention rank of its own); remove it from the FFN role's config"
                )
            if not 0 <= self.attention_rank < self.num_attention_ranks:
                raise ValueError(
                    f"AFD attention_rank {self.attention_rank} is outside 0.."
                    f"{self.num_attention_ranks - 1} (num_attention_ranks="
                    f"{self.num_attention_ranks})"
                )
            if self.spawn_ffn:
                raise ValueError(
                    "spawn_ffn starts the FFN ranks from the deployment of attention rank 0, "
                    "but with attention_rank each attention rank is a deployment of its own "
                    "and the FFN ranks outlive any of them: start them with `vllm afd-ffn`"
                )
            if self.connector != "gloo":
                raise ValueError(
                    f"attention ranks that are deployments of their own (attention_rank) run "
                    f'on the gloo connector; "{self.connector}" serves the data-parallel '
                    "ranks of one deployment only: leave attention_rank out"
                )
        if self.spawn_ffn and self.role != "attention":
            raise ValueError(
                "spawn_ffn is an attention-side option: the attention side "
                "starts the FFN ranks; remove it from the FFN role's config"
            )

    @property
    def separate_attention_ranks(self) -> bool:
        """Attention side: this engine is an attention rank of its own
        (``attention_rank``), not a data-parallel rank of the deployment."""
        return self.attention_rank is not None

    @property
    def attention_ranks_per_ffn_rank(self) -> int:
        """How many attention ranks share one FFN rank (A / F)."""
        return self.num_attention_ranks // self.num_ffn_ranks

    def ffn_rank_of(self, attention_rank: int) -> int:
        """The FFN rank that serves ``attention_rank``."""
        if not 0 <= attention_rank < self.num_attention_ranks:
            raise ValueError(
                f"attention rank {attention_rank} outside 0..{self.num_attention_ranks - 1}"
            )
        return attention_rank // self.attention_ranks_per_ffn_rank

    def attention_ranks_of(self, ffn_rank: int) -> list[int]:
        """The attention ranks that ``ffn_rank`` serves, in peer order."""
        group = self.attention_ranks_per_ffn_rank
        return list(range(ffn_rank * group, (ffn_rank + 1) * group))

    def compile_factors(self) -> dict[str, Any]:
        """The fields that change the computation graph: which half of the
        layer runs here, the transport ops in it and the topology that sizes
        them. Addresses, timeouts and process management do not. vLLM 0.34
        on collects these from each config (``VllmConfig.compile_factors``)."""
        return {
            "role": self.role,
            "connector": self.connector,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "ffn_tensor_parallel_size": self.ffn_tensor_parallel_size,
            "ffn_enable_expert_parallel": self.ffn_enable_expert_parallel,
            "compute_gate_on_attention": self.compute_gate_on_attention,
        }

    def compute_hash(self) -> str:
        """Hash of ``compile_factors`` (vLLM up to 0.33 folds each config's
        hash into ``VllmConfig.compute_hash``)."""
        factors: list[Any] = list(self.compile_factors().values())
        return hashlib.md5(str(factors).encode(), usedforsecurity=False).hexdigest()


def verify_afd_with_vllm_config(vllm_config: VllmConfig) -> None:
    """Check the settings that AFD constrains elsewhere in vLLM; raise a
    ValueError that says what to change, and change nothing.

    Called from ``VllmConfig.__post_init__``, before ``resolve_afd_defaults``
    and the optimization-level defaults. The checks need the AFD runtime
    (which models it splits, MPS, micro-batching, failover), which this
    layer does not import: its one entry point is ``vllm.afd.verify``,
    imported here, when a config is verified, because it imports vLLM
    modules that import this one.
    """
    if vllm_config.afd_config is None:
        return
    from vllm.afd.verify import verify_afd_config

    verify_afd_config(vllm_config)


def resolve_afd_defaults(vllm_config: VllmConfig) -> None:
    """Settle what AFD decides in the other configs of a verified
    ``vllm_config``; called from ``VllmConfig.__post_init__`` right after
    ``verify_afd_with_vllm_config``, before the optimization-level defaults.

    - cudagraph mode: both roles replay CUDA graphs only for uniform decode
      batches, so an unset mode becomes FULL_DECODE_ONLY (verification
      refused any other than that or NONE).
    - FFN role: expert parallelism is ``ffn_enable_expert_parallel``, which
      FusedMoE reads from the parallel config; the group it spans is the
      FFN worker's tensor-parallel group (verification refused the FFN
      side's own --tensor-parallel-size / --enable-expert-parallel).
    """
    from vllm.config.compilation import CUDAGraphMode

    afd = vllm_config.afd_config
    if afd is None:
        return
    if afd.role == "ffn":
        vllm_config.parallel_config.enable_expert_parallel = afd.ffn_enable_expert_parallel
    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode is None:
        compilation.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
