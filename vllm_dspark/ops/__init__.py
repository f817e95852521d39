"""Ops with a Triton kernel and a torch twin of the same signature.

The dispatcher runs the kernel on CUDA tensors and the twin elsewhere (CPU has
no Triton backend); VLLM_DSPARK_OPS=triton|reference forces one side.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def use_triton(t: "torch.Tensor", mode: str | None = None) -> bool:
    """Run the kernel on ``t``? ``mode``: VLLM_DSPARK_OPS, if already read."""
    from vllm_dspark import envs

    mode = mode or envs.VLLM_DSPARK_OPS
    if mode != "auto":
        return mode == "triton"
    return t.is_cuda


def confidence_cutoff(conf: "torch.Tensor", threshold: float, max_len: "torch.Tensor") -> "torch.Tensor":
    """Per-request verify length: the longest prefix with cumulative confidence
    >= threshold, capped by max_len. See ops.reference.confidence_cutoff."""
    if use_triton(conf):
        from vllm_dspark.ops.cutoff import confidence_cutoff as impl
    else:
        from vllm_dspark.ops.reference import confidence_cutoff as impl
    return impl(conf, threshold, max_len)


def rejection_accept(target_p, draft_q, draft_ids, target_argmax, uniforms, cu_num_draft, is_greedy):
    """[B] accepted prefix lengths. See ops.reference.rejection_accept."""
    if use_triton(draft_ids):
        from vllm_dspark.ops.rejection import rejection_accept as impl
    else:
        from vllm_dspark.ops.reference import rejection_accept as impl
    return impl(target_p, draft_q, draft_ids, target_argmax, uniforms, cu_num_draft, is_greedy)


def sample_recovered(target_probs, draft_probs, draft_ids, uniforms):
    """[N] tokens drawn from the residual. See ops.reference.sample_recovered."""
    if use_triton(target_probs):
        from vllm_dspark.ops.rejection import sample_recovered as impl
    else:
        from vllm_dspark.ops.reference import sample_recovered as impl
    return impl(target_probs, draft_probs, draft_ids, uniforms)


# Up to this many candidates (requests x positions) on CPU, ops.scalar's loop
# beats the torch twin (on this CPU 4-6x faster at 7 and 28, 2x at 112, even
# near 220); above it ops.host's NumPy steps do.
SCALAR_MAX_CANDIDATES = 192


def adaptive_lengths(conf, cap, base_cost, token_cost, max_step_time, max_tokens):
    """[R] goodput-optimal verify lengths. See ops.reference.adaptive_lengths."""
    from vllm_dspark import envs

    mode = envs.VLLM_DSPARK_OPS  # read once: this runs every step
    if use_triton(conf, mode):
        from vllm_dspark.ops.adaptive import adaptive_lengths as impl
    elif mode == "auto" and conf.numel() <= SCALAR_MAX_CANDIDATES:
        from vllm_dspark.ops.scalar import adaptive_lengths as impl
    elif mode == "auto":
        from vllm_dspark.ops.host import adaptive_lengths as impl
    else:
        from vllm_dspark.ops.reference import adaptive_lengths as impl
    return impl(conf, cap, base_cost, token_cost, max_step_time, max_tokens)
