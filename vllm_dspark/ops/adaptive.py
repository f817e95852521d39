"""Triton kernel for goodput-optimal verify lengths (twin: reference.adaptive_lengths).

One program handles the whole batch (up to 256 requests x 16 positions = 4096
candidates): survival by a left-to-right product per row, one sort of packed
(survival bits, reversed flat index) keys, float64 prefix sums, the first
non-improving prefix, and a scatter of the admitted candidates to their rows.
"""

# ruff: noqa: N803, N806
import torch
import triton
import triton.language as tl

MAX_CANDIDATES = 4096


@triton.jit
def _adaptive_lengths_kernel(
    conf_ptr, cap_ptr, out_ptr,
    R, stride_r,
    base_cost, token_cost, max_step_time, max_tokens,
    K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < R
    cap = tl.load(cap_ptr + rows, mask=row_ok, other=0)
    acc = tl.full((BLOCK_R,), 1.0, tl.float32)
    surv = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    for j in tl.static_range(K):
        c = tl.load(conf_ptr + rows * stride_r + j, mask=row_ok, other=0.0).to(tl.float32)
        c = tl.where(c == c, c, 0.0)
        c = tl.minimum(tl.maximum(c, 0.0), 1.0)
        acc = acc * c
        keep = (j < cap) & row_ok
        surv = tl.where((cols[None, :] == j) & keep[:, None], acc[:, None], surv)
    N: tl.constexpr = BLOCK_R * BLOCK_K
    REV_BASE = tl.full((), 1 << 30, tl.int32)
    flat_idx = rows[:, None] * K + cols[None, :]
    real = row_ok[:, None] & (cols[None, :] < K)
    # Non-negative floats order like their bit patterns; the low word breaks
    # ties toward the lower flat index. Padding sorts last (key -1).
    bits = surv.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(real, (bits << 32) | (REV_BASE - flat_idx).to(tl.int64), -1)
    key = tl.reshape(key, (N,))
    key = tl.sort(key, descending=True)
    a = ((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True).to(tl.float64)
    idx = REV_BASE - (key & 0xFFFFFFFF).to(tl.int32)
    valid = key >= 0
    a = tl.where(valid, a, 0.0)
    s = tl.cumsum(a, axis=0)
    n = (tl.arange(0, N) + 1).to(tl.float64)
    step = base_cost + token_cost * n
    theta = (R + s) / step
    theta_prev = (R + s - a) / (step - token_cost)
    ok = (theta > theta_prev) & (a > 0) & (step <= max_step_time) & (n <= max_tokens) & valid
    first_fail = tl.min(tl.where(ok, N, tl.arange(0, N)), axis=0)
    admitted = tl.arange(0, N) < first_fail
    tl.atomic_add(out_ptr + idx // K, 1, mask=admitted)



def adaptive_lengths(conf, cap, base_cost, token_cost, max_step_time, max_tokens):
    rows, k = conf.shape
    assert rows * k <= MAX_CANDIDATES, f"at most {MAX_CANDIDATES} candidates, got {rows}x{k}"
    out = torch.zeros(rows, dtype=torch.int32, device=conf.device)
    if rows == 0:
        return out
    conf = conf.float().contiguous()
    _adaptive_lengths_kernel[(1,)](
        conf, cap.to(torch.int32).contiguous(), out, rows, conf.stride(0),
        float(base_cost), float(token_cost), float(max_step_time), float(max_tokens),
        K=k, BLOCK_R=max(2, triton.next_power_of_2(rows)), BLOCK_K=max(2, triton.next_power_of_2(k)),
    )
    return out
