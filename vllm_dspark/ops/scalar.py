"""Plain-Python versions of ops for the small problems the controller solves
on CPU every step. At a few requests the torch twin is a dozen tiny tensor
ops, each paying dispatch (and, between them, waking the intra-op threads):
110-330 us a step on this 2-core CPU, 1-4% of a decode step, where these
loops take a few tens. They give exactly the twin's results (same float32
survivals, same order, same float64 sums; tests/ops/test_adaptive.py)."""

import math

import torch


def adaptive_lengths(conf: torch.Tensor, cap: torch.Tensor, base_cost: float, token_cost: float,
                     max_step_time: float, max_tokens: int) -> torch.Tensor:
    """ops.reference.adaptive_lengths, admitting candidates one by one."""
    rows, k = conf.shape
    # The survivals as the twin has them (float32 products, left to right).
    surv = torch.cumprod(torch.nan_to_num(conf.float(), nan=0.0).clamp(0.0, 1.0), dim=1).tolist()
    candidates = [(a, r) for r, (row, c) in enumerate(zip(surv, cap.tolist())) for a in row[:max(0, min(c, k))]]
    candidates.sort(key=lambda ar: -ar[0])  # stable: ties keep row-major order, as the twin's sort
    lengths = [0] * rows
    total, n = 0.0, 0
    for a, r in candidates:
        step = base_cost + token_cost * (n + 1)
        prev = step - token_cost
        s = total + a
        # A zero cost divides to inf in the twin (the numerators are >= rows > 0).
        theta = (rows + s) / step if step else math.inf
        theta_prev = (rows + s - a) / prev if prev else math.inf
        if not (a > 0 and theta > theta_prev and step <= max_step_time and n + 1 <= max_tokens):
            break
        lengths[r] += 1
        total, n = s, n + 1
    return torch.tensor(lengths, dtype=torch.int32)
