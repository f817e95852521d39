"""Triton kernel for the static confidence cut-off (twin: reference.confidence_cutoff)."""

# ruff: noqa: N803  (Triton constexpr arguments are upper case by convention)
import torch
import triton
import triton.language as tl


@triton.jit
def _confidence_cutoff_kernel(
    conf_ptr,  # [R, K] float32
    max_len_ptr,  # [R] int32
    out_ptr,  # [R] int32
    num_rows,
    stride_r,
    threshold,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < num_rows
    cap = tl.load(max_len_ptr + rows, mask=in_range, other=0)
    acc = tl.full((BLOCK_R,), 1.0, tl.float32)
    length = tl.zeros((BLOCK_R,), tl.int32)
    # Sequential product, left to right: the twin multiplies in the same order.
    for j in tl.static_range(K):
        c = tl.load(conf_ptr + rows * stride_r + j, mask=in_range, other=0.0).to(tl.float32)
        c = tl.where(c == c, c, 0.0)  # NaN -> 0
        c = tl.minimum(tl.maximum(c, 0.0), 1.0)
        acc = acc * c
        length += ((acc >= threshold) & (j < cap)).to(tl.int32)
    tl.store(out_ptr + rows, length, mask=in_range)


def confidence_cutoff(conf: torch.Tensor, threshold: float, max_len: torch.Tensor) -> torch.Tensor:
    assert conf.dim() == 2 and conf.stride(1) == 1, "conf must be [R, K] with unit column stride"
    rows, k = conf.shape
    out = torch.empty(rows, dtype=torch.int32, device=conf.device)
    if rows == 0:
        return out
    block_r = 64
    _confidence_cutoff_kernel[(triton.cdiv(rows, block_r),)](
        conf, max_len.to(torch.int32).contiguous(), out, rows, conf.stride(0), float(threshold),
        K=k, BLOCK_R=block_r,
    )
    return out
