"""Per-row sampling parameters, applied identically to target and draft.

vLLM keeps temperature, top-k, top-p and min-p per request. Verification needs
them per draft token, and the draft must be sampled from the same processed
distribution it is later verified against. This module expands them in plain
torch (vLLM's CPU ``expand_batch_to_tokens`` writes into a copy and leaves
per-token temperatures uninitialised; see shared/docs/verified-here.md).

Processing order matches vLLM's Sampler: temperature, then min-p, then top-k
and top-p, then softmax.
"""

from dataclasses import dataclass

import torch

from vllm_dspark.ops.reference import inverse_cdf_sample  # noqa: F401  (re-export)

# vLLM's Sampler treats temperatures below this as greedy.
GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class RowParams:
    """Sampling parameters for N rows (requests, or draft tokens)."""

    temperature: torch.Tensor  # [N] float32; greedy rows hold 1.0
    is_greedy: torch.Tensor  # [N] bool
    top_k: torch.Tensor | None  # [N] int, >= vocab means off
    top_p: torch.Tensor | None  # [N] float, 1.0 means off
    min_p: torch.Tensor | None  # [N] float, 0.0 means off

    @classmethod
    def from_metadata(cls, md, num_reqs: int, device: torch.device) -> "RowParams":
        """Per-request parameters of the first ``num_reqs`` rows of a vLLM
        SamplingMetadata."""
        if md.all_greedy or md.temperature is None:
            temp = torch.ones(num_reqs, device=device)
            greedy = torch.ones(num_reqs, dtype=torch.bool, device=device)
        else:
            raw = md.temperature[:num_reqs].float()
            greedy = raw < GREEDY_EPS
            temp = torch.where(greedy, torch.ones_like(raw), raw)
        top_k = md.top_k[:num_reqs] if md.top_k is not None else None
        top_p = md.top_p[:num_reqs] if md.top_p is not None else None
        return cls(temp, greedy, top_k, top_p, _min_p(md, num_reqs, device))

    def repeat(self, counts: torch.Tensor) -> "RowParams":
        """Expand per-request rows to per-token rows (counts [N] per row)."""

        def rep(t):
            return None if t is None else torch.repeat_interleave(t, counts.to(t.device), dim=0)

        return RowParams(rep(self.temperature), rep(self.is_greedy), rep(self.top_k),
                         rep(self.top_p), rep(self.min_p))

    @property
    def any_random(self) -> bool:
        return bool((~self.is_greedy).any())


def _min_p(md, num_reqs: int, device: torch.device) -> torch.Tensor | None:
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    for proc in md.logitsprocs.argmax_invariant:
        if isinstance(proc, MinPLogitsProcessor) and proc.min_p_count:
            return torch.from_numpy(proc.min_p_cpu[:num_reqs].copy()).float().to(device)
    return None


def processed_probs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """[N, V] float32 probabilities after temperature, min-p, top-k and top-p.
    Rows of greedy requests come out at temperature 1 (callers use argmax there)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.float() / params.temperature[:, None]
    if params.min_p is not None:
        p = torch.softmax(scaled, dim=-1)
        floor = p.amax(dim=-1, keepdim=True) * params.min_p[:, None]
        scaled = scaled.masked_fill(p < floor, float("-inf"))
    if params.top_k is not None or params.top_p is not None:
        scaled = apply_top_k_top_p(scaled, params.top_k, params.top_p)
    return torch.softmax(scaled, dim=-1)


def row_uniforms(counts: list[int], generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """Uniforms in [0, 1): counts[r] for row r, drawn from the row's own
    generator when the request is seeded, else from the global RNG."""
    total = sum(counts)
    u = torch.rand(total, device=device)
    if generators:
        start = 0
        for r, n in enumerate(counts):
            gen = generators.get(r)
            if gen is not None and n:
                u[start : start + n] = torch.rand(n, generator=gen, device=gen.device).to(device)
            start += n
    return u
