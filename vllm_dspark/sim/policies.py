"""The policies the simulator compares, each seeing one step at a time.

Every policy answers two questions per step, in this order:
  1. ``skip(ids)``: draft at all this step? (decided from past steps only);
  2. ``lengths(...)``: how many of each request's K drafted tokens to verify,
     from this step's confidences (or, for ``stale``, the previous step's).
Only then does the simulator reveal the outcomes (``observe``). The controller
policies (adaptive, threshold, stale, flat-table, calibrated-bound) are the
plugin's DSparkController itself, configured differently; the oracle is not a
policy but a bound computed from the outcomes (engine.oracle_throughput).
"""

import numpy as np
import torch

from vllm_dspark.config import DSparkKnobs
from vllm_dspark.controller.acceptance import AcceptanceModel
from vllm_dspark.controller.controller import DSparkController
from vllm_dspark.controller.cost_curve import CostCurve
from vllm_dspark.controller.cost_model import CostParams
from vllm_dspark.controller.plan import DraftBlocks, StepTiming, StepView, VerifyOutcome
from vllm_dspark.controller.tuning import ControllerTuning

# Confidence logit given to a request's first block by ``stale`` (it has no
# previous step): sigmoid(0) = 0.5.
NO_HISTORY_LOGIT = 0.0
HINDSIGHT_BINS = 20


class Policy:
    name = "policy"
    ran_plain = False  # the last step ran as a step without speculation (priced as no-spec)

    def skip(self, ids: list[str]) -> bool:
        return False

    def lengths(self, ids: list[str], raw: np.ndarray, prev_raw: np.ndarray, greedy: list[bool]) -> np.ndarray:
        raise NotImplementedError

    def observe(self, ids, lengths, accepted, num_reqs, tokens, target_s, draft_s, drafted, left=None) -> None:
        pass


class NoSpec(Policy):
    """An engine without speculation configured: its steps cost curve.nospec."""

    name = "nospec"
    no_drafter = True

    def skip(self, ids):
        return True


class FixedK(Policy):
    def __init__(self, k: int):
        self.k, self.name = k, f"fixed-K{k}"

    def lengths(self, ids, raw, prev_raw, greedy):
        return np.full(raw.shape[0], min(self.k, raw.shape[1]), dtype=np.int64)


class ControllerPolicy(Policy):
    """The plugin's DSparkController, driven through the engine's own calls
    (coasts, begin_step, observe, plan, choose, end_step) in the engine's order: a
    step's target verifies the drafts of the step before, and what that costs
    on ``curve`` reaches the controller through a simulated clock, so it
    learns its costs as when serving (unless ``pinned``) and calibrates online
    (unless handed an ``acceptance`` model). A step the controller runs plain
    (dormant) is priced as a step of an engine without speculation, as the
    runner's plain steps are."""

    def __init__(self, name: str, block_len: int, knobs: dict, curve, pinned: CostCurve | None = None,
                 acceptance: AcceptanceModel | None = None, stale: bool = False):
        self.name, self.stale, self.curve = name, stale, curve
        self._now = 0.0
        # A curve has no warm-up (costs.warm_up): every plain step prices.
        self.ctl = DSparkController(DSparkKnobs(persist_cost_model=False, **knobs), block_len,
                                    tuning=ControllerTuning(price_warmup_steps=0), acceptance=acceptance,
                                    plain_steps=True, now=lambda: self._now)
        if pinned is not None:
            self.ctl.costs.pin(pinned, pinned.name)
        self._live: set[str] = set()
        self._last: VerifyOutcome | None = None  # the drafts this step verifies
        self._target_s = 0.0
        self.coasted = False  # this step coasts (the controller hears of it only through coasts)

    def skip(self, ids):
        r, last, live = len(ids), self._last, set(ids)
        verified = sum(last.num_verified) if last is not None else 0
        view = StepView(tuple(ids), tuple(i for i in ids if i not in self._live), tuple(self._live - live),
                        None, r + verified, 0, verified > 0)
        self._live, self._last = live, None
        self.coasted = self.ctl.coasts(view.req_ids, bool(view.new_req_ids), view.verifies, view.finished_req_ids,
                                       view.tokens)
        self.ran_plain = self.coasted or self.ctl.begin_step(view) is not None
        self._target_s = float(self.curve.spec(r, r + verified) if verified
                               else (self.curve.nospec if self.ran_plain else self.curve.plain)(r, r))
        if self.ran_plain:
            return True
        if verified:
            self.ctl.observe(last)
        return self.ctl.plan(_SimRequests(list(ids), [self.ctl.k] * r)).mode == "skip"

    def lengths(self, ids, raw, prev_raw, greedy):
        conf = torch.from_numpy(prev_raw if self.stale else raw).float()
        return np.asarray(self.ctl.choose(DraftBlocks(list(ids), conf, [raw.shape[1]] * len(ids), greedy)),
                          dtype=np.int64)

    def observe(self, ids, lengths, accepted, num_reqs, tokens, target_s, draft_s, drafted, left=None):
        self._now += self._target_s + draft_s
        if not self.coasted:
            self.ctl.end_step(StepTiming(draft_s, drafted))
        if lengths is not None:
            self._last = VerifyOutcome(list(ids), [int(n) for n in lengths], [int(a) for a in accepted], left)


class _SimRequests:
    """plan.RequestView over the simulator's slots (no request caps below K)."""

    def __init__(self, req_ids: list[str], caps: list[int]):
        self.req_ids, self._caps = req_ids, caps

    def caps(self) -> list[int]:
        return self._caps


class HindsightCalibrator:
    """Per-position acceptance probability by raw-logit bin, fitted on the
    whole trace at once (it knows every outcome in advance) and then frozen:
    what a perfectly calibrated confidence head would report."""

    def __init__(self, trace, greedy: bool):
        k = trace.block_len
        raws, accs = [], []
        for blocks in trace.requests.values():
            for raw, _, g, n, a in blocks:
                if g == greedy:
                    raws.append(raw)
                    accs.append(min(a, n))
        raw = np.array(raws).reshape(-1, k)
        acc = np.array(accs)
        self.edges, self.probs = [], []
        for j in range(k):
            seen = acc >= j  # reached position j: its outcome is known
            z, y = raw[seen, j], (acc[seen] > j).astype(float)
            edges = np.unique(np.quantile(z, np.linspace(0, 1, HINDSIGHT_BINS + 1)[1:-1])) if len(z) else np.array([])
            idx = np.searchsorted(edges, z, side="right")
            # Laplace-smoothed rate per bin; an empty bin gets the position's mean.
            mean = (y.sum() + 1) / (len(y) + 2)
            probs = np.array([(y[idx == b].sum() + mean) / ((idx == b).sum() + 1) for b in range(len(edges) + 1)])
            self.edges.append(edges)
            self.probs.append(probs)

    def calibrate(self, logits: torch.Tensor) -> torch.Tensor:
        z = logits.float().cpu().numpy()
        out = np.stack([self.probs[j][np.searchsorted(self.edges[j], z[:, j], side="right")]
                        for j in range(z.shape[1])], axis=1)
        return torch.from_numpy(out).float()

    def observe(self, *args) -> None:  # frozen: nothing is learned while replaying
        pass

    def state(self) -> dict:
        return {"hindsight_bins": HINDSIGHT_BINS}


def flat_table(curve, num_reqs: int) -> CostCurve:
    """SGLang's fallback without a profiled table: every step costs the same."""
    t = float(curve.spec(num_reqs, num_reqs))
    return CostCurve("flat", CostParams(t, 0.0, 0.0), CostParams(t, 0.0, 0.0), CostParams(0.0, 0.0, 0.0))


def make_policies(trace, curve, num_reqs: int, fixed_ks=(1, 3, 7), threshold: float = 0.3,
                  profiled: CostCurve | None = None) -> list[Policy]:
    """Fresh policies for one (curve, batch size) run. ``profiled`` is the
    profiled-once linear table ``stale`` uses (fit_linear of the curve)."""
    k = trace.block_len
    hindsight = AcceptanceModel(k, ControllerTuning(), calibrators={
        "greedy": HindsightCalibrator(trace, True), "sampled": HindsightCalibrator(trace, False)})
    policies: list[Policy] = [NoSpec()]
    policies += [FixedK(n) for n in fixed_ks if n <= k]
    policies += [
        ControllerPolicy("threshold", k, {"policy": "threshold", "threshold": threshold}, curve),
        ControllerPolicy("adaptive", k, {"policy": "adaptive"}, curve),
        ControllerPolicy("stale", k, {"policy": "adaptive", "calibration": False}, curve, pinned=profiled,
                         stale=True),
        ControllerPolicy("flat-table", k, {"policy": "adaptive", "calibration": False}, curve,
                         pinned=flat_table(curve, num_reqs)),
        ControllerPolicy("calibrated-bound", k, {"policy": "adaptive"}, curve, acceptance=hindsight),
    ]
    return policies
