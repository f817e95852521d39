"""Triton kernels for verification (twins: reference.rejection_accept and
reference.sample_recovered).

rejection_accept compares in float32 exactly as the twin does, so the
accepted lengths agree bit for bit. sample_recovered sums the CDF block by
block, so for a uniform that lands within float rounding of a CDF step it may
pick the neighbouring token; the tests use the twin's semantics otherwise.
"""

# ruff: noqa: N803
import torch
import triton
import triton.language as tl

from vllm_dspark.ops.reference import RESIDUAL_EPS


@triton.jit
def _rejection_accept_kernel(
    p_ptr, q_ptr, draft_ptr, argmax_ptr, u_ptr,  # [T]
    cu_ptr,  # [B] int32 end offsets
    greedy_ptr,  # [B] int8
    out_ptr,  # [B] int32
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    end = tl.load(cu_ptr + r)
    start = tl.load(cu_ptr + r - 1, mask=r > 0, other=0)
    n = end - start
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    idx = start + offs
    if tl.load(greedy_ptr + r) != 0:
        ok = tl.load(draft_ptr + idx, mask=mask, other=-1) == tl.load(argmax_ptr + idx, mask=mask, other=-2)
    else:
        p = tl.load(p_ptr + idx, mask=mask, other=0.0)
        q = tl.load(q_ptr + idx, mask=mask, other=1.0)
        u = tl.load(u_ptr + idx, mask=mask, other=1.0)
        ok = u * q < p
    fail_at = tl.where(mask & (ok == 0), offs, n)
    tl.store(out_ptr + r, tl.min(fail_at, axis=0).to(tl.int32))


def rejection_accept(target_p, draft_q, draft_ids, target_argmax, uniforms, cu_num_draft, is_greedy):
    num_reqs = cu_num_draft.shape[0]
    out = torch.empty(num_reqs, dtype=torch.int32, device=draft_ids.device)
    if num_reqs == 0:
        return out
    counts = torch.diff(cu_num_draft.long(), prepend=cu_num_draft.new_zeros(1).long())
    block = max(16, triton.next_power_of_2(int(counts.max())))
    _rejection_accept_kernel[(num_reqs,)](
        target_p.float().contiguous(), draft_q.float().contiguous(), draft_ids.long().contiguous(),
        target_argmax.long().contiguous(), uniforms.float().contiguous(),
        cu_num_draft.to(torch.int32).contiguous(), is_greedy.to(torch.int8).contiguous(), out,
        BLOCK=block,
    )
    return out


@triton.jit
def _recovery_weights(p_row, q_row, offs, V, use_residual):
    """Unnormalised recovery weights of one vocabulary block: the residual
    max(p - q, 0), or p itself when the residual has no mass."""
    m = offs < V
    p = tl.load(p_row + offs, mask=m, other=0.0)
    q = tl.load(q_row + offs, mask=m, other=0.0)
    return tl.where(use_residual, tl.maximum(p - q, 0.0), p)


@triton.jit
def _sample_recovered_kernel(
    p_ptr, q_ptr,  # [N, V] float32
    u_ptr,  # [N]
    out_ptr,  # [N] int64
    V, stride_p, stride_q, eps,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    p_row = p_ptr + row * stride_p
    q_row = q_ptr + row * stride_q
    mass = 0.0
    for v0 in range(0, V, BLOCK_V):
        mass += tl.sum(_recovery_weights(p_row, q_row, v0 + tl.arange(0, BLOCK_V), V, True), axis=0)
    use_residual = mass > eps
    total = 0.0
    for v0 in range(0, V, BLOCK_V):
        total += tl.sum(_recovery_weights(p_row, q_row, v0 + tl.arange(0, BLOCK_V), V, use_residual), axis=0)
    point = tl.load(u_ptr + row) * total
    running = 0.0
    found = V - 1
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        w = _recovery_weights(p_row, q_row, offs, V, use_residual)
        cdf = tl.cumsum(w, axis=0) + running
        hit = tl.where((offs < V) & (cdf > point), offs, V - 1)
        found = tl.minimum(found, tl.min(hit, axis=0))
        running += tl.sum(w, axis=0)
    tl.store(out_ptr + row, found.to(tl.int64))


def sample_recovered(target_probs, draft_probs, draft_ids, uniforms):
    n, v = target_probs.shape
    out = torch.empty(n, dtype=torch.int64, device=target_probs.device)
    if n == 0:
        return out
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs)
        draft_probs.scatter_(1, draft_ids.long()[:, None], 1.0)
    p = target_probs.float().contiguous()
    q = draft_probs.float().contiguous()
    _sample_recovered_kernel[(n,)](
        p, q, uniforms.float().contiguous(), out, v, p.stride(0), q.stride(0), RESIDUAL_EPS,
        BLOCK_V=min(1024, triton.next_power_of_2(v)),
    )
    return out
