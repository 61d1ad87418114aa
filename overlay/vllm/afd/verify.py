# SPDX-License-Identifier: Apache-2.0
"""The checks of an AFD deployment against the rest of its vLLM config.

``VllmConfig.__post_init__`` runs them (through
``vllm.config.afd.verify_afd_with_vllm_config``, the config layer's one way
into ``vllm.afd``), before ``resolve_afd_defaults`` settles what AFD fixes in
the other configs. They only read: an unsupported setting is an error that
says what to change, and nothing here writes a config or the environment.
What a process of the deployment sets up for itself and the processes it
starts is ``vllm.afd.platform.process_setup``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.afd.attention.dbo import verify_afd_dbo
from vllm.afd.attention.failover import verify_afd_failover
from vllm.afd.models.registry import get_afd_model_spec
from vllm.afd.platform.mps import verify_active_thread_percentage, verify_mps_mode
from vllm.afd.runners import cpu_runner_without_afd_hooks
from vllm.config.compilation import CUDAGraphMode

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def verify_afd_config(vllm_config: VllmConfig) -> None:
    """Refuse settings that AFD does not run with: the model must be one AFD
    can split, each attention rank is one data-parallel rank of a
    single-stage engine, the cudagraph mode is FULL_DECODE_ONLY or NONE
    (or unset, which ``resolve_afd_defaults`` makes FULL_DECODE_ONLY), and
    an attention rank runs on a model runner that AFD's patches reach."""
    afd = vllm_config.afd_config
    if afd is None:
        return
    if vllm_config.model_config is not None:
        architecture = vllm_config.model_config.architecture
        spec = get_afd_model_spec(architecture)  # an unsupported one is an error here
        refusal = spec.refusal()
        if refusal is not None:
            raise ValueError(f"AFD cannot split {architecture} here: {refusal}")
        if spec.exchanges_per_layer > 1 and (
            afd.compute_gate_on_attention or afd.ffn_enable_expert_parallel
        ):
            raise ValueError(
                f"{architecture}'s MoE block runs on a shortcut whose router and experts AFD "
                "keeps together on the FFN rank, in the first of each layer's two exchanges, "
                "and splits its experts over an FFN group by tensor parallelism only; leave "
                "compute_gate_on_attention and ffn_enable_expert_parallel false"
            )
        if afd.compute_gate_on_attention and spec.routing is None:
            raise ValueError(
                f"compute_gate_on_attention places a MoE router, but {architecture} has no "
                "router; leave it false for dense models"
            )
        if afd.ffn_enable_expert_parallel and spec.routing is None:
            raise ValueError(
                f"ffn_enable_expert_parallel shares MoE experts, but {architecture} has "
                "none; leave it false for dense models"
            )
    device = vllm_config.device_config
    if afd.role == "attention" and device is not None and device.device_type == "cpu":
        runner = cpu_runner_without_afd_hooks()
        if runner is not None:
            # The FFN role runs its own runner (vllm.afd.ffn), so only the
            # attention role needs vLLM's to carry AFD's hooks.
            raise RuntimeError(
                f"AFD's attention role needs a model runner that announces each forward to "
                f"the FFN rank, but on this CPU vLLM runs its {runner}, which AFD's patches "
                "do not reach (vLLM picks it on a CPU other than x86 without Triton). "
                "Install Triton with a CPU backend (triton-cpu), so that vLLM runs its "
                "CPUModelRunner, or run the attention role on an x86 CPU or a GPU."
            )
    if device is not None:
        verify_mps_mode(afd.mps, device.device_type)
        if afd.mps_active_thread_percentage:
            verify_active_thread_percentage(device.device_type)
    if afd.connector == "gloo" and device is not None and device.device_type != "cpu":
        raise ValueError(
            f"the AFD gloo connector moves CPU tensors, but this engine runs on "
            f"{device.device_type}; on GPUs use the ipc or nccl connector"
        )
    if afd.ffn_enable_expert_parallel and device is not None and device.device_type == "cpu":
        raise ValueError(
            "ffn_enable_expert_parallel needs GPUs: vLLM's CPU MoE kernels do not run "
            "expert parallelism (stock vLLM on CPU crashes with --enable-expert-parallel "
            "too); on CPU leave it false and split the experts with ffn_tensor_parallel_size"
        )
    # Failover first: it refuses micro-batch overlap on either runner, so a
    # config asking for both hears that before what its runner cannot split.
    verify_afd_failover(vllm_config)
    verify_afd_dbo(vllm_config)
    if vllm_config.speculative_config is not None:
        # A drafter's layers (an MTP layer's MoE among them) and the target's
        # multi-token verification steps would each need steps of their own
        # on the FFN side, which the control plane does not announce.
        raise ValueError(
            "AFD does not run speculative decoding: drop --speculative-config. "
            "A checkpoint's multi-token-prediction layers (DeepSeek-V3's, GLM-4.5's) "
            "are ignored under AFD, as stock vLLM's main model ignores them."
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "AFD splits every decoder layer between the roles, not the layers "
            "between stages: use pipeline_parallel_size=1 (scale out with "
            "num_attention_ranks / num_ffn_ranks)"
        )
    if afd.role == "ffn" and (parallel.tensor_parallel_size > 1 or parallel.enable_expert_parallel):
        raise ValueError(
            "the FFN side's parallelism is set in the AFD config, which both roles "
            "share: drop --tensor-parallel-size / --enable-expert-parallel from the "
            'FFN command and set {"ffn_tensor_parallel_size": N, '
            '"ffn_enable_expert_parallel": true} in --afd-config on both sides'
        )
    if afd.role == "attention" and afd.separate_attention_ranks:
        if parallel.data_parallel_size != 1:
            raise ValueError(
                f"AFD attention_rank={afd.attention_rank} makes this engine one attention rank "
                f"of its own, but it has data_parallel_size={parallel.data_parallel_size}: "
                "drop --data-parallel-size, or leave attention_rank out to run the attention "
                "ranks as the data-parallel ranks of one deployment"
            )
    elif afd.role == "attention" and parallel.data_parallel_size != afd.num_attention_ranks:
        raise ValueError(
            f"AFD num_attention_ranks={afd.num_attention_ranks} but the attention "
            f"deployment has data_parallel_size={parallel.data_parallel_size}: each "
            "attention rank is one data-parallel rank, so the two must match"
        )
    # Both roles replay CUDA graphs only for uniform decode batches.
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode not in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        raise ValueError(
            f"AFD supports cudagraph_mode FULL_DECODE_ONLY or NONE, got "
            f"{mode.name}. Pass -cc.cudagraph_mode=FULL_DECODE_ONLY (or --enforce-eager)."
        )
