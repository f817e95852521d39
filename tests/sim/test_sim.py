"""The trace-driven simulator: its command and outputs, the oracle as a bound,
policy properties (non-anticipation, monotonicity in load, K=1 and R=1), and
the validation replay. Small runs on the committed reference trace; no timing."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from vllm_dspark.controller.cost_curve import CostCurve
from vllm_dspark.controller.cost_model import CostParams
from vllm_dspark.controller.trace import load_trace
from vllm_dspark.sim.curves import LinearCurve, cpu_curve, cpu_regimes, fit_linear, gpu_curves, run_record
from vllm_dspark.sim.engine import draw_blocks, oracle, replay
from vllm_dspark.sim.policies import ControllerPolicy, make_policies

TRACE = REPO / "examples" / "traces" / "tiny-k7-full-c16"
POLICIES = {"nospec", "fixed-K1", "fixed-K3", "fixed-K7", "threshold", "adaptive", "stale", "flat-table",
            "calibrated-bound", "oracle"}


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE)


def _curves(trace):
    steep = CostCurve("steep", CostParams(5e-3, 1e-4, 1e-3), CostParams(5e-3, 1e-4, 1e-3), CostParams(1e-3, 0.0, 0.0))
    return [cpu_curve(trace, run_record(TRACE)), *cpu_regimes(trace.block_len), *gpu_curves(trace.block_len),
            LinearCurve(steep, trace.block_len)]


def test_command_writes_summary_plots_and_validation(tmp_path):
    out = tmp_path / "sim"
    proc = subprocess.run([sys.executable, "-m", "vllm_dspark.sim", "--out", str(out), "--batch-sizes", "1", "8",
                           "--steps", "40", "--warmup", "40", "--cold-start-tokens", "64"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((out / "summary.json").read_text())
    assert {r["policy"] for r in records} == POLICIES
    curves = {"cpu", "cpu-steep", "cpu-flat", "gpu-dense", "gpu-moe"}
    assert {r["curve"] for r in records} == curves
    assert {r["batch_size"] for r in records} == {1, 8}
    for r in records:
        assert set(r) >= {"curve", "batch_size", "policy", "tokens_per_s", "per_request_tokens_per_s", "oracle_fraction"}
        assert r["per_request_tokens_per_s"] == pytest.approx(r["tokens_per_s"] / r["batch_size"])
    assert all((out / f"sim_{c}.png").stat().st_size > 10_000 for c in curves)
    cold = json.loads((out / "cold_start.json").read_text())
    assert {(r["curve"], r["batch_size"]) for r in cold} == {(c, b) for c in curves for b in (1, 8)}
    assert {r["steps"] for r in cold if r["batch_size"] == 8} == {8}  # what no-spec takes for 64 tokens
    targets = json.loads((out / "targets.json").read_text())
    assert targets["checks"] > 0 and targets["met"] + len(targets["misses"]) == targets["checks"]
    validation = json.loads((out / "validation.json").read_text())
    assert set(validation["waves"]) == {"fixed-K7", "nospec"}


def test_no_policy_beats_the_oracle(trace):
    for curve in _curves(trace):
        profiled = fit_linear(curve, trace.block_len, "profiled")
        for r in (1, 4, 32):
            blocks = draw_blocks(trace, r, 120, seed=1)
            best = oracle(blocks, curve, warmup=40).tokens_per_s
            for policy in make_policies(trace, curve, r, profiled=profiled):
                got = replay(policy, blocks, curve, warmup=40).tokens_per_s
                assert got <= best * (1 + 1e-9), (curve.name, r, policy.name, got, best)


class _Recorder:
    """Wraps a policy and keeps (step, lengths) of every drafting step."""

    def __init__(self, policy):
        self.policy, self.name, self.seen, self.step = policy, policy.name, [], -1

    @property
    def ran_plain(self):
        return self.policy.ran_plain

    def skip(self, ids):
        self.step += 1  # the replay asks once per step, first
        return self.policy.skip(ids)

    def lengths(self, *args):
        out = self.policy.lengths(*args)
        self.seen.append((self.step, out.copy()))
        return out

    def observe(self, *args):
        self.policy.observe(*args)


@pytest.mark.parametrize("name", ["adaptive", "threshold", "stale", "calibrated-bound"])
def test_lengths_never_read_their_own_outcomes(trace, name):
    """Change every outcome of step s: every choice up to and including step s
    stays the same (later ones may react to it, as they should)."""
    curve = gpu_curves(trace.block_len)[0]
    s = 220  # a fresh controller runs plain steps first (its exploration budget, its wait for the awake share)
    runs = []
    for flip in (False, True):
        blocks = draw_blocks(trace, 8, 230, seed=2)
        if flip:
            blocks.accepted[s] = trace.block_len - blocks.accepted[s]
        policy = next(p for p in make_policies(trace, curve, 8, profiled=fit_linear(curve, 7, "p")) if p.name == name)
        rec = _Recorder(policy)
        replay(rec, blocks, curve, warmup=0)
        runs.append([(step, lengths) for step, lengths in rec.seen if step <= s])
    assert len(runs[0]) > 10 and len(runs[0]) == len(runs[1])
    for (sa, a), (sb, b) in zip(*runs):
        assert sa == sb and np.array_equal(a, b)


def test_verified_per_request_falls_as_load_rises(trace):
    """On a curve where verified tokens cost real time, the controller verifies
    no more per request at batch 64 than at 16, 4 or 1."""
    steep = CostCurve("steep", CostParams(5e-3, 0.0, 4e-4), CostParams(5e-3, 0.0, 4e-4), CostParams(1e-3, 0.0, 0.0))
    curve = LinearCurve(steep, trace.block_len)
    per_request = []
    for r in (1, 4, 16, 64):
        blocks = draw_blocks(trace, r, 200, seed=3)
        policy = ControllerPolicy("adaptive", trace.block_len, {"policy": "adaptive"}, curve, pinned=steep)
        res = replay(policy, blocks, curve, warmup=50)
        per_request.append(res.verified / max(res.drafted_steps, 1) / r)
    assert all(a >= b for a, b in zip(per_request, per_request[1:])), per_request
    assert per_request[0] > per_request[-1]


def _tiny_trace(tmp_path, k):
    rng = np.random.default_rng(0)
    lines = [json.dumps({"kind": "header", "version": 1, "block_len": k})]
    for req in range(6):
        for step in range(30):
            raw = rng.normal(1.0, 1.0, k).round(3).tolist()
            acc = int(rng.integers(0, k + 1))
            lines.append(json.dumps({"kind": "block", "step": step, "req": f"r{req}", "greedy": True, "raw": raw,
                                     "cal": [0.5] * k, "verified": k, "accepted": acc}))
    for step in range(60):
        lines.append(json.dumps({"kind": "step", "step": step, "reqs": 2, "tokens": 2 * (k + 1), "seconds": 0.01}))
    lines.append(json.dumps({"kind": "costs", "step": 50, "spec": {"t0": 0.005, "t_req": 1e-4, "t_tok": 2e-4},
                             "plain": {"t0": 0.005, "t_req": 1e-4, "t_tok": 0.0},
                             "draft": {"t0": 0.001, "t_req": 1e-4, "t_tok": 0.0}}))
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "t.jsonl"


def test_k1_and_batch_1_run_and_stay_under_the_oracle(tmp_path):
    out = tmp_path / "out"
    path = _tiny_trace(tmp_path, k=1)
    proc = subprocess.run([sys.executable, "-m", "vllm_dspark.sim", "--out", str(out), "--trace", str(path),
                           "--batch-sizes", "1", "2", "--steps", "30", "--warmup", "10", "--cold-start-tokens", "30"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((out / "summary.json").read_text())
    # K=1: fixed-K3 and fixed-K7 do not exist; everything else does.
    assert {r["policy"] for r in records} == POLICIES - {"fixed-K3", "fixed-K7"}
    assert all(0 < r["oracle_fraction"] <= 1 + 1e-9 for r in records)
    assert not (out / "validation.json").exists()  # no run.json beside this trace


def test_bad_trace_path_fails_with_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vllm_dspark.sim", "--out", str(tmp_path), "--trace",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode != 0 and "no trace file there" in proc.stderr


def test_replaying_the_recorded_run_matches_its_measurement(trace):
    from vllm_dspark.sim.__main__ import validate

    run = run_record(TRACE)
    v = validate(trace, run, cpu_curve(trace, run))
    # The trace's own steps, priced by the curve its run learned.
    assert 0.85 < v["step_time_replay_ratio"] < 1.15
    for arm in v["waves"].values():
        assert abs(arm["error_pct"]) < 15, v
