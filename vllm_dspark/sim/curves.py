"""Step-cost curves for the simulator: T_spec(R, B), T_plain(R, B) and
T_draft(R) in seconds, for R requests and B target tokens (one per request
plus the verified drafts).

Four sources:
  * ``cpu``: the linear fits the plugin's online cost models reached while
    recording the trace (the trace's last ``costs`` line);
  * ``cpu-steep`` and ``cpu-flat``: the two regimes measured on machines of
    this kind (constants below);
  * ``gpu-dense`` and ``gpu-moe``: rooflines on H200 (constants below, formulas
    in docs/simulator.md);
  * any JSON file in the plugin's cost-curve format
    (vllm_dspark/controller/cost_curve.py).
All functions take numpy arrays or scalars and are non-decreasing in B.
"""

from dataclasses import asdict, dataclass

import numpy as np

from vllm_dspark.controller.cost_curve import CostCurve, load_cost_curve
from vllm_dspark.controller.cost_model import CostParams


class LinearCurve:
    """T = t0 + t_req R + t_tok B for each of spec, plain and draft (draft B = R K)."""

    kind = "linear"

    def __init__(self, curve: CostCurve, block_len: int):
        self.name, self.curve, self.k = curve.name, curve, block_len

    @staticmethod
    def _t(p: CostParams, r, b):
        return np.maximum(1e-6, p.t0 + p.t_req * np.asarray(r, float) + p.t_tok * np.asarray(b, float))

    def spec(self, r, b):
        return self._t(self.curve.spec, r, b)

    def plain(self, r, b):
        return self._t(self.curve.plain, r, b)

    def draft(self, r):
        return self._t(self.curve.draft, r, np.asarray(r, float) * self.k)

    def nospec(self, r, b):
        return self._t(self.curve.nospec or self.curve.plain, r, b)

    def describe(self) -> dict:
        return {"kind": self.kind, **self.curve.to_json()}


# H200 (SXM) published peaks: HBM3e bandwidth and dense tensor throughput.
H200_BANDWIDTH = 4.8e12  # bytes/s
H200_BF16_FLOPS = 989e12
H200_FP8_FLOPS = 1979e12


@dataclass(frozen=True)
class Roofline:
    """One target + drafter on ``gpus`` H200s (tensor/expert parallel: the
    weights, KV and FLOPs are spread over all of them)."""

    name: str
    gpus: int
    dense_params: float  # read by every step (attention, dense MLPs, shared experts, head)
    expert_params: float  # routed experts, all layers (0: a dense model)
    experts: int  # routed experts per layer
    top_k: int  # experts each token is routed to
    weight_bytes: float  # bytes per parameter
    peak_flops: float  # per GPU, at the weights' precision
    kv_bytes_per_token: float  # all layers
    attn_width: float  # layers x attention width, for the 4 L d attention FLOPs per token
    context: float  # mean context length of a running request
    overhead_s: float  # fixed per target step (launch, scheduler, collectives)
    draft_params: float  # drafter weights read per drafting pass (its layers + LM head)
    draft_bytes: float  # bytes per drafter parameter
    markov_params: float  # Markov head (rank x vocab), re-read at each of the K positions
    draft_overhead_s: float
    bandwidth_eff: float = 0.8  # achievable fraction of peak bandwidth
    flops_eff: float = 0.6  # achievable fraction of peak FLOPs

    @property
    def active_params(self) -> float:
        return self.dense_params + self.expert_params * (self.top_k / self.experts if self.experts else 0.0)


QWEN3_8B_H200 = Roofline(
    name="gpu-dense", gpus=1, dense_params=8.19e9, expert_params=0.0, experts=0, top_k=0,
    weight_bytes=2.0, peak_flops=H200_BF16_FLOPS,
    kv_bytes_per_token=2 * 36 * 8 * 128 * 2,  # K and V, 36 layers, 8 KV heads of 128, bf16
    attn_width=36 * 32 * 128, context=2048, overhead_s=0.5e-3,
    draft_params=5 * 193e6 + 151936 * 4096, draft_bytes=2.0,  # 5 Qwen3-8B-wide layers + LM head
    markov_params=256 * 151936, draft_overhead_s=0.3e-3,
)
# DeepSeek-V4-Flash-like: the public description gives only the class, so these
# are stated assumptions: ~284B parameters, FP8, 256 routed experts (top-8) per
# layer and ~6B always-read parameters (~14.7B active), MLA-style compressed KV,
# on an 8 x H200 node with expert/tensor parallelism.
DEEPSEEK_FLASH_LIKE_8XH200 = Roofline(
    name="gpu-moe", gpus=8, dense_params=6e9, expert_params=278e9, experts=256, top_k=8,
    weight_bytes=1.0, peak_flops=H200_FP8_FLOPS,
    kv_bytes_per_token=61 * 576,  # 61 layers x 576 compressed values, FP8
    attn_width=61 * 128 * 192, context=2048, overhead_s=2.0e-3,  # collectives dominate the fixed cost
    draft_params=1.5e9 + 129280 * 7168, draft_bytes=2.0, markov_params=256 * 129280, draft_overhead_s=0.5e-3,
)


class RooflineCurve:
    """T(R, B) = overhead + max(bytes / (BW eff), FLOPs / (peak eff)), where
    bytes = dense weights + touched experts' weights + the running requests' KV,
    and FLOPs = B (2 x active params + 4 x attention width x context). A step
    of B tokens touches a fraction 1 - (1 - top_k / experts)^B of the experts."""

    kind = "roofline"

    def __init__(self, model: Roofline, block_len: int):
        self.model, self.name, self.k = model, model.name, block_len

    def _bandwidth(self):
        return H200_BANDWIDTH * self.model.bandwidth_eff * self.model.gpus

    def _flops(self):
        return self.model.peak_flops * self.model.flops_eff * self.model.gpus

    def spec(self, r, b):
        m = self.model
        r, b = np.asarray(r, float), np.asarray(b, float)
        touched = 1.0 - (1.0 - m.top_k / m.experts) ** b if m.experts else 0.0
        weight_bytes = (m.dense_params + m.expert_params * touched) * m.weight_bytes
        kv_bytes = r * m.context * m.kv_bytes_per_token
        flops = b * (2 * m.active_params + 4 * m.attn_width * m.context)
        return m.overhead_s + np.maximum((weight_bytes + kv_bytes) / self._bandwidth(), flops / self._flops())

    plain = spec  # same kernels with or without drafts to verify
    nospec = spec  # and without speculation configured at all

    def draft(self, r):
        """One parallel drafting pass over R blocks of K + 1 positions (the
        drafter reads its own short context's KV, left out), then K Markov
        steps, each re-reading the rank x vocab table."""
        m = self.model
        r = np.asarray(r, float)
        tokens = r * (self.k + 1)
        bytes_ = (m.draft_params + self.k * m.markov_params) * m.draft_bytes
        flops = 2 * tokens * m.draft_params + 2 * r * self.k * m.markov_params
        return m.draft_overhead_s + np.maximum(bytes_ / self._bandwidth(), flops / self._flops())

    def describe(self) -> dict:
        return {"kind": self.kind, "h200_bandwidth": H200_BANDWIDTH, **asdict(self.model)}


def fit_linear(curve, block_len: int, name: str, batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> CostCurve:
    """Least-squares linear fit of a curve over the (R, B) a block-``block_len``
    run visits: what a profile taken once at start-up would store."""
    rows, spec, plain, draft = [], [], [], []
    for r in batch_sizes:
        for extra in range(0, block_len + 1):
            b = r * (1 + extra)
            rows.append((1.0, r, b))
            spec.append(float(curve.spec(r, b)))
            plain.append(float(curve.plain(r, b)))
    x = np.array(rows)
    fits = [np.linalg.lstsq(x, np.array(y), rcond=None)[0] for y in (spec, plain)]
    xd = np.array([(1.0, r, r * block_len) for r in batch_sizes])
    fd = np.linalg.lstsq(xd[:, :2], np.array([float(curve.draft(r)) for r in batch_sizes]), rcond=None)[0]
    clip = lambda v: max(float(v), 0.0)  # noqa: E731
    spec_p, plain_p = (CostParams(clip(f[0]) or 1e-6, clip(f[1]), clip(f[2])) for f in fits)
    return CostCurve(name, spec_p, plain_p, CostParams(clip(fd[0]), clip(fd[1]), 0.0))


def cpu_curve(trace, run: dict | None = None, name: str = "cpu") -> LinearCurve:
    """Verify and drafting steps: the fits the plugin's online models reached
    while the trace was recorded. Plain steps (a DSpark engine that skips the
    drafter): the plain model of a DSpark engine that always skips
    (``run["skip"]["curve"]``); the engine without speculation:
    the no-spec engine's measured decode step (``run["nospec"]["curve"]``);
    both from benchmarks/record_traces.py. A full-block trace has no
    decode-only plain steps to learn from (its plain model saw only
    prefills); without them, a plain step costs what a verify step without
    drafts does."""
    from vllm_dspark.controller.cost_curve import curve_from_json

    if trace.costs is None:
        raise ValueError(f"trace {trace.files} has no 'costs' line; record at least 50 steps")
    data = {k: trace.costs[k] for k in ("spec", "draft")}
    for key, source in (("plain", "skip"), ("nospec", "nospec")):
        if run and source in run:
            data[key] = run[source]["curve"]
    return LinearCurve(curve_from_json({"name": name, **data}, where=f"{trace.files[0]} costs"), trace.block_len)


def run_record(trace_path) -> dict | None:
    """run.json next to a trace (written by benchmarks/record_traces.py), if any."""
    import json
    from pathlib import Path

    p = Path(trace_path)
    f = (p if p.is_dir() else p.parent) / "run.json"
    return json.loads(f.read_text()) if f.is_file() else None


def json_curve(path: str, block_len: int) -> LinearCurve:
    return LinearCurve(load_cost_curve(path), block_len)


# Two CPU regimes of the same tiny pair (bf16, 2 cores), as linear curves.
# Steep: an AMD EPYC without AVX-512, where vLLM's bf16 linear layers fall back
# to torch: about 8 ms a step plus 3 ms per token (no-spec 10.7 ms at c=1,
# ~210 ms at c=64), drafting about as dear per block. Flat: the Intel Xeon
# AVX-512/AMX machines, about 4 ms plus 0.1 ms per token, one block's drafting
# about 4.6 ms at c=1.
CPU_REGIMES = (
    CostCurve("cpu-steep", CostParams(8e-3, 0.0, 3e-3), CostParams(8e-3, 0.0, 3e-3), CostParams(4e-3, 1e-3, 0.0)),
    CostCurve("cpu-flat", CostParams(4e-3, 0.0, 1e-4), CostParams(4e-3, 0.0, 1e-4), CostParams(4e-3, 2e-4, 0.0)),
)


def cpu_regimes(block_len: int) -> list[LinearCurve]:
    return [LinearCurve(curve, block_len) for curve in CPU_REGIMES]


def gpu_curves(block_len: int) -> list[RooflineCurve]:
    return [RooflineCurve(QWEN3_8B_H200, block_len), RooflineCurve(DEEPSEEK_FLASH_LIKE_8XH200, block_len)]


def describe_point(curve, r: int) -> dict:
    """Milliseconds at batch ``r``: a plain step, a full-block verify step and a drafting pass."""
    k = curve.k
    return {"plain_ms": 1e3 * float(curve.plain(r, r)), "full_verify_ms": 1e3 * float(curve.spec(r, r * (k + 1))),
            "draft_ms": 1e3 * float(curve.draft(r))}
