"""DSparkController without vLLM: policies, caps and per-request bookkeeping."""

import math

import pytest
import torch

from vllm_dspark.config import DSparkKnobs
from vllm_dspark.controller.controller import DSparkController


def _ctl(**knobs):
    return DSparkController(DSparkKnobs(persist_cost_model=False, **knobs), block_len=4)


def test_policies_and_caps():
    logits = torch.tensor([[4.0, 4.0, 4.0, 4.0], [-4.0, 4.0, 4.0, 4.0]])
    greedy = [True, True]
    assert _ctl(policy="full").choose(["a", "b"], logits, [4, 2], greedy) == [4, 2]
    assert _ctl(policy="threshold", threshold=0.5).choose(["a", "b"], logits, [4, 4], greedy) == [4, 0]
    assert _ctl(policy="adaptive").choose(["a", "b"], logits, [0, 4], greedy)[0] == 0  # dspark_max_verify=0


def test_request_caps_from_extra_args():
    ctl = _ctl()
    assert ctl.request_caps([None, {}, {"dspark_max_verify": 2}, {"other": 1}]) == [4, 4, 2, 4]


def test_outcomes_follow_request_ids_across_reordering():
    """Rows reorder between steps (vLLM condenses its batch); outcomes must be
    matched to the confidences of the same request."""
    ctl = _ctl(policy="full")
    logits = torch.tensor([[5.0, 5.0, 5.0, 5.0], [-5.0, -5.0, -5.0, -5.0]])
    ctl.choose(["sure", "hopeless"], logits, [4, 4], [True, True])
    # next step, the batch lists them the other way round
    ctl.verified(["hopeless", "sure"], [4, 4], [0, 4])
    bins = ctl.calibrators["greedy"].bins["raw"]
    # position 0: a confident accept (top bin, outcome 1) and a doubtful reject (bottom bin, outcome 0)
    assert bins[0, -1].tolist() == pytest.approx([1.0, float(torch.sigmoid(torch.tensor(5.0))), 1.0])
    assert bins[0, 0].tolist()[::2] == [1.0, 0.0]
    assert ctl._pending is None  # nothing carried past the step that used it


def test_adaptive_shrinks_under_token_cost():
    ctl = _ctl()
    logits = torch.full((16, 4), 1.0)  # ~0.73 per position
    cheap = sum(ctl.choose([str(i) for i in range(16)], logits, [4] * 16, [True] * 16))
    for _ in range(300):  # the machine turns out to pay 2 ms per token
        ctl.cost.observe(16, 64, 5e-3 + 2e-3 * 64)
        ctl.cost.observe(16, 16, 5e-3 + 2e-3 * 16)
    dear = sum(ctl.choose([str(i) for i in range(16)], logits, [4] * 16, [True] * 16))
    assert dear < cheap


@pytest.mark.parametrize("rows,conf,base,tok,max_step,max_tokens", [
    (1, [0.9, 0.8, 0.5, 0.2], 5e-3, 1e-4, math.inf, 1 << 30),
    (64, [0.9, 0.8, 0.5, 0.2], 5e-3, 1e-4, math.inf, 1 << 30),
    (64, [0.9, 0.8, 0.5, 0.2], 5e-3, 1e-3, math.inf, 1 << 30),  # verification dear: fewer levels
    (16, [0.95] * 7, 5e-3, 1e-4, 5e-3 + 40e-4, 1 << 30),  # step cap cuts a level
    (16, [0.95] * 7, 5e-3, 1e-4, math.inf, 21),  # token cap cuts a level
    (8, [0.0, 0.9], 5e-3, 1e-4, math.inf, 1 << 30),  # nothing survives
])
def test_uniform_admission_matches_the_op_on_identical_rows(rows, conf, base, tok, max_step, max_tokens):
    """The skip rule's closed form agrees with ops.adaptive_lengths when every
    request has the same confidences."""
    from vllm_dspark.controller.controller import uniform_admission
    from vllm_dspark.ops.reference import adaptive_lengths

    c = torch.tensor([conf] * rows, dtype=torch.float32)
    cap = torch.full((rows,), len(conf), dtype=torch.int32)
    lengths = adaptive_lengths(c, cap, base, tok, max_step, max_tokens)
    surv = torch.cumprod(c, 1)
    gain = float(surv[torch.arange(len(conf))[None, :] < lengths[:, None].long()].sum())
    n, g = uniform_admission([float(x) for x in c[0]], rows, base, tok, max_step, max_tokens)
    assert n == int(lengths.sum())
    assert g == pytest.approx(gain, rel=1e-5)


def test_probes_back_off_only_once_costs_are_measured():
    """While skipping on priors alone, probes keep every PROBE_EVERY-th step
    (they are what measures drafting); once the drafting model is trusted,
    the gap between probes doubles."""
    from vllm_dspark.controller import controller as cc

    ctl = _ctl(slo_tokens_per_s=1e6)  # no step can meet it: never pays
    ctl.choose(["a"], torch.zeros(1, 4), [4], [True])

    def probe_gaps(steps):
        gaps, run = [], 0
        for _ in range(steps):
            if ctl.should_skip_drafting(1):
                run += 1
            else:
                gaps.append(run)
                run = 0
        return gaps

    assert set(probe_gaps(80)) == {cc.PROBE_EVERY - 1}
    # Only the drafting model: with no length worth verifying, probes verify
    # nothing and the verify-step model is never measured; that must not keep
    # probing at full pace forever.
    for _ in range(cc.MIN_OBSERVATIONS):
        ctl.draft_cost.observe(1, 4, 0.01)
    gaps = probe_gaps(400)
    # the pace in force when trust arrives runs out, then each gap doubles
    assert gaps[:4] == [7, 15, 31, 63]
