"""Controller traces: what a traced run writes reads back exactly, tracing off
writes nothing, and malformed files are rejected with file, line and field."""

import pytest
import torch

from vllm_dspark.config import DSparkKnobs
from vllm_dspark.controller.controller import DSparkController
from vllm_dspark.controller.plan import DraftBlocks, StepTiming, StepView, VerifyOutcome
from vllm_dspark.controller.trace import TraceError, load_trace


def _traced_run(trace_dir, steps=60):
    """Steps of 2 requests that verify 8 tokens, each 10 ms + 1 ms per step so far."""
    clock = [0.0]
    ctl = DSparkController(DSparkKnobs(policy="full", persist_cost_model=False, trace_dir=str(trace_dir)),
                           block_len=3, now=lambda: clock[0])
    gen = torch.Generator().manual_seed(0)
    written, prev, logits = [], None, None
    for s in range(steps + 1):
        ids = ["a", "b"] if s % 2 else ["b", "a"]  # rows reorder between steps
        ctl.begin_step(StepView(tuple(ids), (), (), None, 8, 0, s > 0))
        if s == steps:
            break
        if s:  # the blocks drafted on the step before, in that step's row order
            acc = [(s - 1) % 4, 1]
            ctl.observe(VerifyOutcome(ids, [3, 3], acc))
            row = prev.index("a")
            written.append((logits[row].tolist(), row == 0, acc[ids.index("a")]))
        prev, logits = ids, torch.randn(2, 3, generator=gen)
        ctl.choose(DraftBlocks(ids, logits, [3, 3], [True, False]))
        clock[0] += 0.01 + 0.001 * s
        ctl.end_step(StepTiming(0.002, 2))
    ctl.close()
    return ctl, written


def test_trace_round_trip(tmp_path):
    ctl, written = _traced_run(tmp_path)
    trace = load_trace(tmp_path)
    assert trace.block_len == 3 and len(trace.steps) == 60 and trace.costs is not None
    a = trace.requests[next(k for k in trace.requests if k.endswith(":a"))]
    assert len(a) == 59  # the last step's blocks are never verified
    for (logits, was_greedy, acc), (raw, cal, greedy, n, accepted) in zip(written, a):
        assert raw == pytest.approx(logits, abs=1e-4) and n == 3 and accepted == acc
        assert greedy == was_greedy
        assert all(0.0 <= c <= 1.0 for c in cal)
    assert [s["seconds"] for s in trace.steps][:2] == pytest.approx([0.01, 0.011])
    # A step says what it verified and accepted: its blocks' sums.
    assert [s["draft_tokens"] for s in trace.steps] == [0] + [6] * 59
    assert sum(s["accepted"] for s in trace.steps) == sum(b[4] for blocks in trace.requests.values() for b in blocks)


def test_tracing_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctl = DSparkController(DSparkKnobs(policy="full", persist_cost_model=False), block_len=3)
    for verifies in (False, True):
        ctl.begin_step(StepView(("a",), (), (), None, 4, 0, verifies))
        if verifies:
            ctl.observe(VerifyOutcome(["a"], [3], [1]))
        ctl.choose(DraftBlocks(["a"], torch.zeros(1, 3), [3], [True]))
        ctl.end_step(StepTiming(0.0, 1))
    ctl.close()
    assert ctl.telemetry.trace is None and not list(tmp_path.iterdir())


BAD = {
    "not JSON": ('{"kind": "header", "version": 1, "block_len": 3}\n{oops\n', r"t\.jsonl:2: not JSON"),
    "no header": ('{"kind": "step", "reqs": 1, "tokens": 1, "seconds": 0.1}\n', r":1: the first line must be the header"),
    "wrong version": ('{"kind": "header", "version": 9, "block_len": 3}\n', r"trace version 9"),
    "short block": ('{"kind": "header", "version": 1, "block_len": 3}\n'
                    '{"kind": "block", "req": "a", "greedy": true, "raw": [0], "cal": [0], "verified": 1, "accepted": 0}\n',
                    r':2: "raw" and "cal" must have block_len=3'),
    "accepted > verified": ('{"kind": "header", "version": 1, "block_len": 1}\n'
                            '{"kind": "block", "req": "a", "greedy": true, "raw": [0], "cal": [0], "verified": 1, "accepted": 2}\n',
                            r"accepted \(2\) <= verified \(1\)"),
    "missing field": ('{"kind": "header", "version": 1, "block_len": 1}\n{"kind": "block", "req": "a"}\n',
                      r":2: block record lacks or mangles a field"),
    "unknown kind": ('{"kind": "header", "version": 1, "block_len": 1}\n{"kind": "nap"}\n', r"unknown kind 'nap'"),
    "no blocks": ('{"kind": "header", "version": 1, "block_len": 1}\n', r"no block records"),
    "empty": ("", r"empty file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_trace_is_rejected(case, tmp_path):
    text, pattern = BAD[case]
    (tmp_path / "t.jsonl").write_text(text)
    with pytest.raises(TraceError, match=pattern):
        load_trace(tmp_path / "t.jsonl")


def test_missing_trace_path_is_rejected(tmp_path):
    with pytest.raises(TraceError, match="no trace file there"):
        load_trace(tmp_path / "nowhere")
