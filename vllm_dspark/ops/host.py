"""NumPy version of the adaptive-lengths op, for CPU problems too big for
ops.scalar's loop. The torch twin is about thirty small tensor ops, each
paying torch's dispatch: 110-240 µs at 64 requests x 7 positions on this
2-core CPU (1-2% of a decode step there), where these steps took 50-90. The
result is the twin's exactly: the same float32 survivals (left to right),
the same stable descending order, and the same float64 sums and comparisons
in the same order (tests/ops/test_adaptive.py).
"""

import math

import numpy as np
import torch


def adaptive_lengths(conf: torch.Tensor, cap: torch.Tensor, base_cost: float, token_cost: float,
                     max_step_time: float, max_tokens: int) -> torch.Tensor:
    """ops.reference.adaptive_lengths on host arrays."""
    rows, k = conf.shape
    surv = survivals(conf)
    cap = cap.detach().cpu().numpy()
    if (cap < k).any():
        surv[np.arange(k)[None, :] >= cap[:, None]] = 0.0
    flat = surv.ravel()
    order = np.argsort(-flat, kind="stable")  # descending; ties keep row-major order
    a = flat[order].astype(np.float64)
    total = np.cumsum(a)
    total += rows  # R + s
    n = np.arange(1, a.size + 1, dtype=np.float64)
    step = token_cost * n
    step += base_cost
    with np.errstate(divide="ignore", invalid="ignore"):  # zero costs divide to the twin's inf/nan
        ok = total / step > (total - a) / (step - token_cost)
    ok &= a > 0
    if not max_step_time >= step.max(initial=-math.inf):  # (NaN caps everything, as in the twin)
        ok &= step <= max_step_time
    if max_tokens < a.size:
        ok &= n <= max_tokens
    first_fail = int(ok.argmin()) if ok.size else 0
    admitted = first_fail if ok.size and not ok[first_fail] else a.size  # the all-ok prefix
    return torch.from_numpy(np.bincount(order[:admitted] // k, minlength=rows).astype(np.int32))


def survivals(conf: torch.Tensor) -> np.ndarray:
    """[R, K] float32 survivals, the twin's bit for bit: fmax/fmin drop NaN
    (the twin's nan_to_num(0) then clamp(0, 1)), and the products run left to
    right in float64, each rounded to float32, as torch's CPU cumprod does."""
    c = np.fmax(conf.detach().float().cpu().numpy(), 0.0)
    np.fmin(c, 1.0, out=c)
    return np.multiply.accumulate(c.astype(np.float64), axis=1).astype(np.float32)
