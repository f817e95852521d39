"""Verify policies: how many of each block's drafted tokens to verify.

Chosen once from the ``policy`` knob (``make_policy``), behind one
``lengths`` method, as vLLM's DraftLengthPolicy is. Each sees this step's
calibrated confidences [B, K] and per-row caps [B], both known before the
drafted tokens are looked at; confidences of position j come from tokens
before j, so every cut is non-anticipating and verification stays lossless.
"""

import math
from typing import Protocol

import torch

from vllm_dspark import ops
from vllm_dspark.config import DSparkKnobs
from vllm_dspark.controller.costs import StepCosts
from vllm_dspark.controller.plan import StepView
from vllm_dspark.controller.tuning import ControllerTuning


class VerifyPolicy(Protocol):
    name: str
    gates_drafting: bool  # the drafting gate runs (skip, depth, dormancy): adaptive only
    needs_confidence_head: bool  # the drafter must have one

    def lengths(self, conf: torch.Tensor, cap: torch.Tensor, costs: StepCosts, view: StepView,
                depth: int, max_tokens: int | None = None) -> torch.Tensor:
        """Verify lengths [B] int32, each within its cap; adaptive: at most
        ``max_tokens`` in all (the exploration budget's; None: no limit)."""


class FullPolicy:
    """Verify every drafted token (within caps)."""

    name, gates_drafting, needs_confidence_head = "full", False, False

    def lengths(self, conf, cap, costs, view, depth, max_tokens=None):
        return cap


class ThresholdPolicy:
    """The longest prefix whose cumulative calibrated confidence is at least ``threshold``."""

    name, gates_drafting, needs_confidence_head = "threshold", False, True

    def __init__(self, threshold: float):
        self.threshold = threshold

    def lengths(self, conf, cap, costs, view, depth, max_tokens=None):
        return ops.confidence_cutoff(conf, self.threshold, cap)


class AdaptivePolicy:
    """Goodput-optimal lengths for the predicted cost of the next step
    (ops.adaptive_lengths), within the SLO's step-time cap and, while
    requests wait, the scheduler's token headroom."""

    name, gates_drafting, needs_confidence_head = "adaptive", True, True

    def __init__(self, tuning: ControllerTuning, slo_tokens_per_s: float | None):
        self.slo = slo_tokens_per_s
        self._every, self._shift, self._spread = tuning.vary_lengths_every, tuning.vary_shift, tuning.min_token_spread
        self._choices = 0
        self._rng = torch.Generator().manual_seed(0)

    def lengths(self, conf, cap, costs, view, depth, max_tokens=None):
        rows = conf.shape[0]
        self._choices += 1
        est = costs.predict(rows, view.prefill_tokens, depth)
        max_time, limit = step_limits(view, rows, self.slo)
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        lengths = ops.adaptive_lengths(conf, cap, est.base + est.draft, est.per_token, max_time, limit)
        # While verify steps all carry about the same tokens the per-token cost
        # is not identified: now and then every length moves by one common
        # random shift, drawn without looking at the drafts (still lossless).
        if (self._choices % self._every == 0 and not costs.verify.pinned
                and costs.verify.token_spread() < self._spread):
            shift = int(torch.randint(-self._shift, self._shift + 1, (1,), generator=self._rng))
            lengths = torch.minimum(torch.clamp(lengths + shift, min=0), cap).to(torch.int32)
            if max_tokens is not None:
                lengths = within(lengths, limit)
        return lengths


def within(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``lengths`` cut to at most ``total`` tokens in all, level by level
    (every row's last position first), the earlier rows keeping a split level."""
    if int(lengths.sum()) <= total:
        return lengths
    level = 0
    while int(torch.clamp(lengths, max=level + 1).sum()) <= total:
        level += 1
    cut = torch.clamp(lengths, max=level)
    extra = (lengths > level).to(torch.int32)
    keep = total - int(cut.sum())
    extra[torch.cumsum(extra, 0) > keep] = 0
    return (cut + extra).to(torch.int32)


def step_limits(view: StepView, rows: int, slo_tokens_per_s: float | None) -> tuple[float, int]:
    """(step-time cap from the SLO floor, draft-token cap from the headroom):
    while requests are queued, drafts may only use budget prefills leave free."""
    load = view.load
    max_tokens = 1 << 30
    if load is not None and load.waiting > 0:
        max_tokens = max(0, load.token_budget - rows - view.prefill_tokens)
    return (1.0 / slo_tokens_per_s if slo_tokens_per_s else math.inf), max_tokens


def make_policy(knobs: DSparkKnobs, tuning: ControllerTuning) -> VerifyPolicy:
    if knobs.policy == "full":
        return FullPolicy()
    if knobs.policy == "threshold":
        return ThresholdPolicy(knobs.threshold)
    return AdaptivePolicy(tuning, knobs.slo_tokens_per_s)
