"""Pure-torch twins of the Triton ops in this package.

Each twin has the same signature and output dtype as its kernel and is what
runs on CPU. They are written for clarity; the tests hold the kernels to them.
"""

import torch

# Residual mass below this is numerical noise (p == q): fall back to p.
RESIDUAL_EPS = 1e-8


def confidence_cutoff(
    conf: torch.Tensor,  # [R, K] float32, per-position conditional confidence
    threshold: float,
    max_len: torch.Tensor,  # [R] int32, per-request cap (0..K)
) -> torch.Tensor:  # [R] int32
    """Longest prefix whose cumulative confidence prod(c_1..c_j) >= threshold.

    Non-anticipating: whether position j is kept depends on c_1..c_j only, and
    c_j is computed from tokens before position j. The product runs left to
    right in float32, the same order as the kernel, so the two agree exactly.
    Confidences are clamped to [0, 1]; NaN counts as 0.
    """
    c = torch.nan_to_num(conf.float(), nan=0.0).clamp(0.0, 1.0)
    acc = torch.ones(c.shape[0], dtype=torch.float32, device=c.device)
    length = torch.zeros(c.shape[0], dtype=torch.int32, device=c.device)
    for j in range(c.shape[1]):
        acc = acc * c[:, j]
        length += ((acc >= threshold) & (j < max_len)).to(torch.int32)
    return length


def rejection_accept(
    target_p: torch.Tensor,  # [T] float32, target prob of each draft token (random rows)
    draft_q: torch.Tensor,  # [T] float32, draft prob of each draft token (1.0 = one-hot)
    draft_ids: torch.Tensor,  # [T] int64
    target_argmax: torch.Tensor,  # [T] int64
    uniforms: torch.Tensor,  # [T] float32 in [0, 1)
    cu_num_draft: torch.Tensor,  # [B] int32, cumulative draft counts (end offsets)
    is_greedy: torch.Tensor,  # [B] bool
) -> torch.Tensor:  # [B] int32, accepted prefix length per request
    """Accepted prefix per request. Greedy rows accept while the draft equals
    the target argmax; random rows accept token t iff u_t * q_t(x) < p_t(x),
    i.e. with probability min(1, p/q) (Leviathan et al. 2023)."""
    num_reqs = cu_num_draft.shape[0]
    ends = cu_num_draft.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    req_of = torch.repeat_interleave(torch.arange(num_reqs, device=draft_ids.device), counts)
    local = torch.arange(draft_ids.shape[0], device=draft_ids.device) - (ends - counts)[req_of]
    greedy_ok = draft_ids == target_argmax
    random_ok = uniforms * draft_q < target_p
    ok = torch.where(is_greedy[req_of], greedy_ok, random_ok)
    # accepted length = index of the first failing draft (or the count if none)
    fail_at = torch.where(ok, counts[req_of], local)
    return counts.scatter_reduce(0, req_of, fail_at, reduce="amin").to(torch.int32)


def sample_recovered(
    target_probs: torch.Tensor,  # [N, V] float32, rows where a draft was rejected
    draft_probs: torch.Tensor | None,  # [N, V] float32, or None for one-hot drafts
    draft_ids: torch.Tensor,  # [N] int64, the rejected draft tokens
    uniforms: torch.Tensor,  # [N] float32 in [0, 1)
) -> torch.Tensor:  # [N] int64
    """Sample from the residual max(p - q, 0) (renormalised) by inverse CDF with
    one uniform per row; if the residual has no mass, sample from p."""
    if draft_probs is None:
        q = torch.zeros_like(target_probs)
        q.scatter_(1, draft_ids[:, None], 1.0)
    else:
        q = draft_probs
    residual = (target_probs - q).clamp(min=0.0)
    mass = residual.sum(dim=1, keepdim=True)
    return inverse_cdf_sample(torch.where(mass > RESIDUAL_EPS, residual, target_probs), uniforms)


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalised non-negative weights [N, V]; a
    zero-weight entry is never picked (strict comparison on the CDF)."""
    cdf = weights.cumsum(dim=1)
    idx = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(1)
    return idx.clamp(max=weights.shape[1] - 1)


def adaptive_lengths(
    conf: torch.Tensor,  # [R, K] float32, calibrated conditional confidences
    cap: torch.Tensor,  # [R] int32, per-request maximum verify length (0..K)
    base_cost: float,  # predicted step seconds with no drafts verified
    token_cost: float,  # predicted extra seconds per verified draft token
    max_step_time: float,  # SLO: predicted step time may not exceed this (inf: none)
    max_tokens: int,  # token headroom: at most this many draft tokens in total
) -> torch.Tensor:  # [R] int32 verify lengths
    """Goodput-optimal verify lengths (DSpark paper, Algorithm 1).

    Survival a[r, j] = prod_{i<=j} c[r, i]. All (r, j) are admitted in
    descending survival (ties: lower flat index first, so a request's
    positions come in order), and admission stops at the first candidate that
    does not strictly raise expected goodput

        Theta_n = (R + sum of the n admitted survivals) / (base + token_cost * n),

    or that would break the step-time or token cap. Whether (r, j) is verified
    depends only on candidates ranked before it, none of which is a later
    position of the same request, so the choice is non-anticipating.
    Sums run in float64.
    """
    rows, k = conf.shape
    c = torch.nan_to_num(conf.float(), nan=0.0).clamp(0.0, 1.0)
    surv = torch.cumprod(c, dim=1)  # float32, left to right, like the kernel's loop
    surv.masked_fill_(torch.arange(k, device=c.device)[None, :] >= cap[:, None], 0.0)
    flat = surv.reshape(-1)
    a, order = torch.sort(flat, descending=True, stable=True)
    a = a.double()
    s = a.cumsum(0)
    n = torch.arange(1, a.numel() + 1, device=c.device, dtype=torch.float64)
    step = base_cost + token_cost * n
    ok = ((rows + s) / step > (rows + s - a) / (step - token_cost)) & (a > 0)
    ok &= (step <= max_step_time) & (n <= max_tokens)
    admitted = int(ok.int().cumprod(0).sum())  # length of the all-ok prefix
    return torch.bincount(order[:admitted] // k, minlength=rows).to(torch.int32)
