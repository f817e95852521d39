"""DSparkController: each step, how many drafted tokens each request verifies.

It runs in the worker, next to the runner, and sees per step:
  * the scheduler's load (running, waiting, KV usage, tokens scheduled and the
    headroom under max_num_batched_tokens), stamped on the SchedulerOutput;
  * the measured time of each step (worker busy time plus the engine's gap
    between steps), split into the drafter's share and the rest. Three online
    cost models learn them: T_spec(R, B) for a target step that verifies
    drafts (B tokens), T_plain(R, B) for one that does not, and T_draft(R) for
    drafting R blocks;
  * what verification did with last step's drafts, which trains the
    per-position calibration of the confidence head;
  * this step's fresh confidences for the blocks it must cut.

Policies (additional_config["dspark"]["policy"]):
  * full: verify the whole block;
  * threshold: longest prefix with cumulative calibrated confidence >= threshold;
  * adaptive (default): goodput-optimal lengths (ops.adaptive_lengths) for the
    predicted cost of the next step, with an optional step-time cap from the
    SLO floor and a token cap from the scheduler's headroom when requests wait;
    and when even the best lengths would not pay for the drafting itself
    (the tokens they would gain are worth less than the time drafting and
    verifying take, a token valued at a plain decode step's cost per token
    at the batch about to run), the drafter is skipped for the step (it
    still writes its context KV), with a probe step now and then to keep the
    estimates fresh. When it drafts, the same rule picks how deep the Markov
    head walks (d <= K positions, each a round of small ops whatever the
    batch size; a fourth online model, T_walk(R), prices one), and lengths
    stop at d.
A request's own `dspark_max_verify` (SamplingParams.extra_args) caps it, and
so do the tokens it has left before max_tokens.
Every input to the choice is known before the drafted tokens are looked at,
and the per-position confidences come from earlier tokens only, so the lengths
are non-anticipating and verification stays lossless.
"""

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_dspark import ops
from vllm_dspark.config import MAX_VERIFY_KEY, DSparkKnobs
from vllm_dspark.controller.calibration import PositionCalibrator
from vllm_dspark.controller.cost_curve import CostCurve, load_cost_curve
from vllm_dspark.controller.cost_model import ERROR_WINDOW, CostParams, OnlineCostModel
from vllm_dspark.controller.signals import LoadSignals, load_of, prefill_tokens
from vllm_dspark.controller.survival import SurvivalWindow
from vllm_dspark.controller.trace import TraceWriter

# The engine's work between two steps (the engine core taking in one step's
# output and scheduling the next, the round trips) is charged to the step
# before it: it grows with what that step produced, so a verify step leaves a
# longer gap than a plain one. Gaps longer than MAX_ENGINE_GAP_S are idle
# time; such a step is charged its kind's usual gap (an EMA).
MAX_ENGINE_GAP_S = 0.05
GAP_EMA = 0.9
SAVE_EVERY_STEPS = 500
# The plain and verify-step models are each fitted on their own steps, and the
# engine runs mostly one kind at a time, so when the load moves, the other
# kind's model extrapolates in R from another batch size (badly: fitted at one
# R, it splits the step time between t0 and t_req arbitrarily). A model that
# has not seen about this many requests lately is replaced by the other one
# plus or minus the verify path's measured overhead (an EMA over plain steps).
OVERHEAD_EMA = 0.9
# While speculation does not pay, drafting is skipped, except on probe steps,
# which refresh the survival and drafting-cost estimates. Until the drafting
# cost is measured, one step in PROBE_EVERY is a probe. After that the wait is
# set so that probing costs about PROBE_LOSS_BUDGET of the throughput: a
# probe's predicted loss is the goodput it gives up against a plain step,
# over the time it takes.
# Where speculation nearly pays, a probe costs next to nothing and comes every
# PROBE_EVERY steps (the estimates decide most there, and a few probes drawn
# from one request would bias them); far from paying, it comes seldom, at
# most MAX_PROBE_EVERY steps apart.
PROBE_EVERY = 8
MAX_PROBE_EVERY = 1024
PROBE_LOSS_BUDGET = 0.005
# While speculating, one step in this many skips drafting anyway, so the plain
# step's cost stays measured (it is what speculation is compared against).
EXPLORE_EVERY = 256
# While the verify-step model's data has too little spread in B (relative
# partial std below MIN_TOKEN_SPREAD), one drafting step in VARY_LENGTHS_EVERY
# shifts every request's chosen length by the same random amount in
# -VARY_SHIFT..VARY_SHIFT (drawn without looking at the drafts, so still
# lossless): steps that all verify about the same number of tokens cannot tell
# the per-token cost from the fixed cost. A common shift moves B by up to
# VARY_SHIFT per request at any batch size, at the price of a few tokens.
VARY_LENGTHS_EVERY = 32
VARY_SHIFT = 3
MIN_TOKEN_SPREAD = 0.1
# Until a step-cost model has this many observations it is not trusted.
MIN_OBSERVATIONS = 20
# Dormant (see should_skip_drafting) once at least this share of the last
# knobs.dormant_after_steps steps skipped drafting: a lone drafting step (a
# probe, a benchmark wave's first request alone for a step) must not keep
# the requests after it from being admitted dormant.
DORMANT_SKIP_SHARE = 0.9
# ... and only with at least this many requests about to run: a small batch's
# context costs little to keep, and there dormancy only slows the rule down
# (rechecks every 8 steps; a c=1 benchmark run with it skipped 24% of its
# steps, against 12% in an earlier run without it, where full K=7 beat no
# speculation by 34%).
DORMANT_MIN_REQS = 8
# While dormant, the full rule (whether drafting would pay again, which ends
# dormancy, and whether a probe is due) runs only every this many steps: it
# is about 1% of a decode step at c=16 on this CPU.
DORMANT_RECHECK_EVERY = 8
# Dormancy ends once drafting would pay on this many checks in a row: when a
# benchmark wave ends, the next one's first request runs alone for a step or
# two, where drafting pays; ended there, the wave's first requests were
# admitted with context and drafted until the skip share built up again
# (at c=16, 92 of 352 requests, 133 drafting steps; adaptive 0.86x no-spec).
DORMANT_EXIT_CHECKS = 2
# While dormant, the cost models learn from one plain step in this many: such
# steps are alike, and recording each (two model updates and the error window)
# was a quarter of what a dormant step spent in the controller.
DORMANT_RECORD_EVERY = 4


@dataclass
class StepRecord:
    """What the controller did and saw in one step (for metrics and logs)."""

    num_reqs: int = 0
    num_tokens: int = 0
    predicted_s: float | None = None
    measured_s: float | None = None
    budget: int = 0  # draft tokens chosen for verification next step
    lengths: list[int] = field(default_factory=list)


class DSparkController:
    def __init__(self, knobs: DSparkKnobs, block_len: int, fingerprint: str = "",
                 cache_dir: Path | None = None, trace_dir: str | None = None):
        self.knobs = knobs
        self.k = block_len
        cache = cache_dir if knobs.persist_cost_model else None
        def model(kind):
            return OnlineCostModel(f"{fingerprint}-{kind}" if fingerprint else "", cache)

        self.cost = model("spec")  # target steps that verify drafts
        self.plain_cost = model("plain")  # target steps that do not
        self.draft_cost = model("draft")  # drafting less the Markov walk
        self.walk_cost = model("walk")  # one position of the Markov walk, T_walk(R)
        if knobs.cost_curve:
            self.pin_costs(load_cost_curve(knobs.cost_curve), knobs.cost_curve)
        # Acceptance means different things at temperature 0 (argmax match) and
        # above (min(1, p/q)), so each mode gets its own calibration.
        self.calibrators = ({"greedy": PositionCalibrator(block_len), "sampled": PositionCalibrator(block_len)}
                            if knobs.calibration else None)
        self.steps = 0
        self.last = StepRecord()
        # Positions the Markov head walks on the next drafting step: K, unless
        # the skip rule finds fewer pay more (policy adaptive).
        self.depth = block_len
        self.totals = {"steps": 0, "budget_tokens": 0, "length_hist": [0] * (block_len + 1),
                       "depth_hist": [0] * (block_len + 1),
                       "skipped_steps": 0, "verified_blocks": 0, "accepted_tokens": 0,
                       "contextless_requests": 0, "plain_steps": 0}
        # Recent blocks for the skip rule: mean calibrated survival per position
        # (the mean of the products, not the product of the means: confidences
        # along a block are correlated, and the latter undercounts the gain).
        self._window = SurvivalWindow(block_len)
        self._step_errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # whole-step prediction error
        self._skips_in_row = 0
        self._since_skip = 0
        # Whether the drafter ran, for the last knobs.dormant_after_steps
        # steps, and how many of them skipped it.
        self._recent_skips: deque[bool] = deque(maxlen=max(1, knobs.dormant_after_steps))
        self._recent_skipped = 0
        # Drafting was skipped on nearly all recent steps and does not pay now:
        # requests admitted meanwhile get no drafter context (the runner).
        self.dormant = False
        self._dormant_skips = 0  # cheap skips since the rule last ran
        self._dormant_plain = 0  # dormant plain steps finished (see DORMANT_RECORD_EVERY)
        self._paying_checks = 0  # dormant checks in a row where drafting would pay
        self._choices = 0
        self._rng = torch.Generator().manual_seed(0)
        self._step_verifies = False
        # The last choice: (req id -> row, raw confidence logits [B][K], greedy
        # per row, calibrated confidences [B, K] when tracing, each row's slot
        # in the survival window)
        self._pending: tuple[dict[str, int], list[list[float]], list[bool], torch.Tensor | None,
                             list[int | None]] | None = None
        self._t_start: float | None = None
        self._t_end_prev: float | None = None
        self._gap_s = {False: 0.0, True: 0.0}  # usual gap after a plain / a verify step
        self._verify_overhead: float | None = None  # verify step minus plain step, same R and B
        # The last step's (requests, tokens, verifies, seconds, drafting seconds,
        # drafted), recorded once the gap after it is known.
        self._unrecorded: tuple | None = None
        self._load: LoadSignals | None = None
        self._step_reqs = 0
        self._step_tokens = 0
        self._step_prefill = 0
        trace_dir = knobs.trace_dir or trace_dir
        self._trace = (TraceWriter(trace_dir, {"block_len": block_len, "policy": knobs.policy})
                       if trace_dir else None)

    def pin_costs(self, curve: CostCurve, source: str) -> None:
        """Use ``curve``'s fixed costs instead of learning them online."""
        for model, params in ((self.cost, curve.spec), (self.plain_cost, curve.plain),
                              (self.draft_cost, curve.draft), (self.walk_cost, curve.walk)):
            if params is not None:
                model.pin(params, source)

    # -- step boundaries ---------------------------------------------------
    def step_started(self, scheduler_output) -> None:
        now = time.perf_counter()
        if self._unrecorded is not None:
            r, b, verifies, seconds, draft_seconds, drafted, walk = self._unrecorded
            self._unrecorded = None
            gap = now - self._t_end_prev
            if gap < MAX_ENGINE_GAP_S:
                self._gap_s[verifies] = GAP_EMA * self._gap_s[verifies] + (1 - GAP_EMA) * gap
            else:
                gap = self._gap_s[verifies]
            self.record_step(r, b, verifies, seconds + gap, draft_seconds, drafted, *walk)
        self._t_start = now
        self._load = load = load_of(scheduler_output)
        self._step_reqs = len(scheduler_output.num_scheduled_tokens)
        self._step_tokens = int(scheduler_output.total_num_scheduled_tokens)
        # Read only while prompts wait (see _next_prefill): a pass over every request.
        self._step_prefill = prefill_tokens(scheduler_output) if load is None or load.waiting > 0 else 0
        self._step_verifies = bool(scheduler_output.scheduled_spec_decode_tokens)

    def step_finished(self, draft_seconds: float, drafted_reqs: int, excluded_seconds: float = 0.0,
                      walk_seconds: float = 0.0) -> None:
        """End of a step; ``draft_seconds`` of it went to the drafting path,
        which drafted ``drafted_reqs`` blocks (0: the drafter was skipped and
        only took in context, a cost counted with the plain step),
        ``excluded_seconds`` of that to work that belongs to no model (the
        queued context of earlier skipped steps) and ``walk_seconds`` to the
        Markov walk, ``self.depth`` positions deep."""
        if self._t_start is None:
            return
        now = time.perf_counter()
        self._t_end_prev = now
        t_start, self._t_start = self._t_start, None
        if self._step_reqs == 0:
            return
        if self.dormant and not drafted_reqs and not self._step_verifies and self._trace is None:
            self._dormant_plain += 1
            if self._dormant_plain % DORMANT_RECORD_EVERY:
                self._count_step()
                return
        self._unrecorded = (self._step_reqs, self._step_tokens, self._step_verifies,
                            now - t_start - excluded_seconds, draft_seconds - excluded_seconds, drafted_reqs,
                            (walk_seconds, self.depth) if drafted_reqs and walk_seconds > 0 else ())

    def record_step(self, r: int, b: int, verifies: bool, seconds: float, draft_seconds: float,
                    drafted_reqs: int, walk_seconds: float = 0.0, depth: int = 0) -> None:
        """A step of ``r`` requests and ``b`` target tokens took ``seconds``
        (``draft_seconds`` of it drafting ``drafted_reqs`` blocks, and
        ``walk_seconds`` of that walking ``depth`` positions; 0: not timed
        apart): the cost models learn from it. The simulator calls this with
        simulated times."""
        target = self.cost if verifies else self.plain_cost
        target_seconds = max(seconds - (draft_seconds if drafted_reqs else 0.0), 1e-6)
        predicted = target.params.predict(r, b)
        if not verifies and _trusted(self.cost) and self.cost.covers(r):
            # What the verify path costs over a plain step of the same size:
            # the bridge between the two models (see _step_costs).
            over = self.cost.params.predict(r, b) - target_seconds
            self._verify_overhead = (OVERHEAD_EMA * self._verify_overhead + (1 - OVERHEAD_EMA) * over
                                     if self._verify_overhead is not None else over)
        if drafted_reqs:
            walked = depth > 0 and walk_seconds > 0
            predicted += self._draft_seconds(drafted_reqs, depth if walked else self.k)
            self.draft_cost.observe(drafted_reqs, drafted_reqs * self.k,
                                    draft_seconds - walk_seconds if walked else draft_seconds)
            if walked:
                self.walk_cost.observe(drafted_reqs, 0, walk_seconds / depth)
        target.observe(r, b, target_seconds)
        self.last.num_reqs, self.last.num_tokens = r, b
        self.last.predicted_s, self.last.measured_s = predicted, seconds
        self._step_errors.append(abs(predicted - seconds) / seconds)
        if self._trace is not None:
            self._trace.step(self._trace_costs, step=self.steps, reqs=r, tokens=b, seconds=seconds,
                             draft_seconds=draft_seconds, drafted=drafted_reqs, verifies=verifies)
        self._count_step()

    def _count_step(self) -> None:
        self.steps += 1
        if self.steps % SAVE_EVERY_STEPS == 0:
            self.close()

    # -- verification outcomes --------------------------------------------
    def verified(self, req_ids: list[str], num_verified: list[int], accepted: list[int]) -> None:
        """What the sampler did with each request's drafts this step."""
        pending, self._pending = self._pending, None
        self.totals["verified_blocks"] += sum(1 for n in num_verified if n)
        self.totals["accepted_tokens"] += sum(accepted)
        if pending is None:
            return
        if self._trace is not None:
            self._trace_blocks(pending, req_ids, num_verified, accepted)
        rows_of, raw, greedy, _, slots = pending
        # Outcomes per survival-window slot, and per calibration mode for the
        # blocks that were verified at all.
        window = ([], [], [])
        picks = {"greedy": ([], [], []), "sampled": ([], [], [])}
        for rid, n, a in zip(req_ids, num_verified, accepted):
            i = rows_of.get(rid)
            if i is None:
                continue
            if slots[i] is not None:
                _append_outcome(window, slots[i], n, a)
            if n:
                _append_outcome(picks["greedy" if greedy[i] else "sampled"], i, n, a)
        self._window.outcome(*window)
        if self.calibrators is None:
            return
        self._window.changed()
        for mode, (rows, ver, acc) in picks.items():
            if rows:
                self.calibrators[mode].observe([raw[i] for i in rows], ver, acc)

    # -- the choice -------------------------------------------------------
    def choose(self, req_ids: list[str], conf_logits: torch.Tensor, caps: list[int],
               greedy: list[bool]) -> list[int]:
        """Verify lengths [B] for this step's blocks (raw confidence logits [B, K])."""
        conf = self.calibrated(conf_logits, greedy)
        raw = conf_logits.detach().float().cpu()
        # A block that may verify nothing never gets an outcome, and one
        # drafted without context says nothing of the others: neither joins
        # the skip rule's window.
        kept = [i for i, c in enumerate(caps) if c > 0]
        slots: list[int | None] = [None] * len(caps)
        if kept:
            picked = self._window.add(raw if len(kept) == len(caps) else raw[kept],
                                      [greedy[i] for i in kept], self.steps)
            for i, slot in zip(kept, picked):
                slots[i] = slot
        # Past the walked depth there are no drafts to verify.
        cap = torch.tensor(caps, dtype=torch.int32, device=conf.device).clamp(0, min(conf.shape[1], self.depth))
        self.totals["depth_hist"][self.depth] += 1
        policy = self.knobs.policy
        if policy == "full":
            lengths = cap
        elif policy == "threshold":
            lengths = ops.confidence_cutoff(conf, self.knobs.threshold, cap)
        else:
            self._choices += 1
            lengths = self._adaptive(conf, cap)
            if (self._choices % VARY_LENGTHS_EVERY == 0 and not self.cost.pinned
                    and self.cost.token_spread() < MIN_TOKEN_SPREAD):
                shift = int(torch.randint(-VARY_SHIFT, VARY_SHIFT + 1, (1,), generator=self._rng))
                lengths = torch.minimum(torch.clamp(lengths + shift, min=0), cap).to(torch.int32)
        out = lengths.tolist()
        # Only positions before a request's verify length get an outcome, and
        # the calibrator reads no further (verified caps what it observes).
        # Rows of floats: the calibration queues them.
        self._pending = ({rid: i for i, rid in enumerate(req_ids)}, raw.tolist(), greedy,
                         conf if self._trace is not None else None, slots)
        self._record(out)
        return out

    def calibrated(self, conf_logits: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
        """Conditional acceptance probabilities [B, K] from raw logits."""
        if self.calibrators is None:
            return torch.sigmoid(conf_logits.float())
        if all(greedy) or not any(greedy):
            return self.calibrators["greedy" if greedy[0] else "sampled"].calibrate(conf_logits)
        mask = torch.tensor(greedy, device=conf_logits.device)[:, None]
        return torch.where(mask, self.calibrators["greedy"].calibrate(conf_logits),
                           self.calibrators["sampled"].calibrate(conf_logits))

    def _step_costs(self, rows: int, prefill: int | None = None,
                    depth: int | None = None) -> tuple[float, float, float, float]:
        """Predicted seconds for the next step with ``rows`` decoding requests
        beside ``prefill`` prompt tokens (default: the prompt work expected
        with it): (verify step without its drafts, plain step, drafting
        ``depth`` deep (default: this step's depth), per verified draft
        token)."""
        tokens = rows + (self._next_prefill() if prefill is None else prefill)
        spec = self.cost.params
        spec_base = spec.predict(rows, tokens)
        plain = self.plain_cost.params.predict(rows, tokens) if _trusted(self.plain_cost) else spec_base
        over = self._verify_overhead
        if over is not None:
            fresh_spec, fresh_plain = self.cost.covers(rows), self.plain_cost.covers(rows)
            if fresh_spec and not fresh_plain:
                plain = max(spec_base - over, 1e-6)
            elif fresh_plain and not fresh_spec:
                spec_base = plain + over
        # A verify step never costs less than a plain one with the same tokens;
        # until verify steps have been seen (all skipped, or cut to nothing),
        # the plain model stands in for them.
        base = max(spec_base, plain) if _trusted(self.cost) else plain
        return base, plain, self._draft_seconds(rows, self.depth if depth is None else depth), spec.t_tok

    def _draft_seconds(self, rows: int, depth: int) -> float:
        """Predicted drafting time for ``rows`` blocks walked ``depth`` deep."""
        par = self.draft_cost.params.predict(rows, rows * self.k)
        return par + depth * self.walk_cost.params.predict(rows, 0) if self._walk_known() else par

    def _walk_known(self) -> bool:
        """Is the walk priced apart (and so its depth chosen)? Not when the
        knob says no, nor while its model is young, nor with a pinned cost
        curve without a "walk" (its drafting cost holds the walk)."""
        return (self.knobs.adaptive_depth and _trusted(self.walk_cost)
                and (self.walk_cost.pinned or not self.draft_cost.pinned))

    def _next_prefill(self) -> int:
        """Prompt tokens expected beside the next step's decodes: this step's,
        while prompts still wait behind them; none once the queue is empty
        (the last chunk of a burst must not make drafts look cheap)."""
        load = self._load
        return self._step_prefill if load is None or load.waiting > 0 else 0

    def _token_value(self, rows: int) -> float:
        """Seconds of engine time one more token is worth: what a plain decode
        step spends per token at the batch about to run. That is the batch of
        every admitted or queued request (up to max_num_seqs), not this step's
        rows: while prompts are being taken in, a token gained for one request
        with 63 more about to decode is worth a 64th of a decode step, not a
        whole one. Prompt work is left out: it makes a step's tokens look dear
        only while it lasts."""
        coming = self._coming(rows)
        return self._step_costs(coming, prefill=0)[1] / coming

    def _coming(self, rows: int) -> int:
        """The batch about to run: every admitted or queued request, up to
        max_num_seqs, and at least this step's ``rows``."""
        load = self._load
        if load is None:
            return rows
        queued = load.running + load.waiting
        return max(rows, min(queued, load.max_running) if load.max_running else queued)

    def _caps(self, rows: int) -> tuple[float, int]:
        """(step-time cap from the SLO floor, draft-token cap from the headroom)."""
        load = self._load
        max_tokens = 1 << 30
        if load is not None and load.waiting > 0:
            # Requests are queued: drafts may only use budget prefills leave free.
            max_tokens = max(0, load.token_budget - rows - self._next_prefill())
        slo = self.knobs.slo_tokens_per_s
        return (1.0 / slo if slo else math.inf), max_tokens

    def _adaptive(self, conf: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        rows = conf.shape[0]
        base, _, draft, per_token = self._step_costs(rows)
        return ops.adaptive_lengths(conf, cap, base + draft, per_token, *self._caps(rows))

    def _record(self, lengths: list[int]) -> None:
        self.last.budget = sum(lengths)
        self.last.lengths = lengths
        self.totals["steps"] += 1
        self.totals["budget_tokens"] += self.last.budget
        for n in lengths:
            self.totals["length_hist"][n] += 1

    def should_skip_drafting(self, num_reqs: int, caps: Callable[[], list[int]] | None = None,
                             draftable: Callable[[], int] | None = None) -> bool:
        """Skip the drafter this step? Only under policy=adaptive, when the
        tokens speculation is expected to gain (best lengths for recent
        confidences, within each request's cap, read from ``caps()``, default
        K) are worth less engine time than drafting and verifying them costs.
        In a steady decode that is the goodput rule (speculation's tokens per
        second against a plain step's). The drafter then only takes in its
        context (queued). While dormant (drafting skipped for a while and not
        paying, DORMANT_MIN_REQS or more requests coming) this rule runs every
        DORMANT_RECHECK_EVERY steps only, and the runner admits new requests
        without drafter context. Always skipped when none of the requests has
        context: ``draftable()`` says how many have (default all), called once
        ``dormant`` is set for this step (the runner admits this step's new
        requests by it). Decided from past steps and this step's load only:
        non-anticipating."""
        if self.knobs.policy != "adaptive" or num_reqs == 0:
            return False
        if self.dormant and self._dormant_skips < DORMANT_RECHECK_EVERY - 1:
            if draftable is not None:
                draftable()  # this step's admissions, by the last verdict
            self._dormant_skips += 1
            self._skips_in_row += 1  # a probe falls due as it would have
            return self._skip()
        self._dormant_skips = 0
        estimate = self._window.estimate(self.calibrated)
        if estimate is None:
            self.depth = self.k
            return self._skip() if draftable is not None and draftable() == 0 else self._drafts()
        mean_surv, ratio = estimate
        base, plain, draft_k, per_token = self._step_costs(num_reqs, depth=self.k)
        max_step, max_tokens = self._caps(num_reqs)
        surv = [min(1.0, s * ratio) for s in mean_surv]
        levels = [s / p if p > 0 else 0.0 for s, p in zip(surv, [1.0, *surv[:-1]])]
        value = self._token_value(num_reqs)
        shallow = self._walk_known()
        walk = self.walk_cost.params.predict(num_reqs, 0) if shallow else 0.0

        def saved(counts):
            """(seconds speculation saves this step, negative: what it loses;
            at the depth that saves the most; what drafting and verifying
            cost there). The levels admitted at depth K
            are cut at each depth (a shallower walk makes the step cheaper,
            which would admit a level less only where it barely pays either
            way)."""
            taken = admitted_levels(levels, num_reqs, base + draft_k, per_token, max_step, max_tokens, counts)
            best, n, gain = None, 0, 0.0
            for depth in range(1, self.k + 1):
                if depth <= len(taken):
                    take, level_surv = taken[depth - 1]
                    n, gain = n + take, gain + take * level_surv
                if depth == self.k or shallow:
                    spend = base - plain + draft_k - walk * (self.k - depth) + per_token * n
                    net = gain * value - spend
                    if best is None or net >= best[0]:  # ties: the deeper walk (more to learn from)
                        best = (net, depth, spend)
            return best

        net, self.depth, spend = saved(None)
        # Dormant: drafting was skipped on nearly all recent steps and would
        # not pay now even with every request drafted. It ends once drafting
        # would pay on DORMANT_EXIT_CHECKS checks in a row (load that drops
        # ends it, though the requests left have no context).
        if self.dormant:
            # Ending it must pay beyond the cost models' recent error: it
            # costs what no model sees (every new request's context queued
            # and written again), and a rule near break-even flips on noise.
            # A check below the load dormancy begins at counts whatever the
            # models say: nothing drafts while dormant (the runner's steps then
            # give the drafter no context), so a model that is far off (a
            # pinned curve from another machine) must not hold a light load.
            sure = net > self._model_error() * spend or self._coming(num_reqs) < DORMANT_MIN_REQS
            self._paying_checks = self._paying_checks + 1 if sure else 0
            self.dormant = self._paying_checks < DORMANT_EXIT_CHECKS
        else:
            recent = self._recent_skips
            self.dormant = (bool(self.knobs.dormant_after_steps) and len(recent) == recent.maxlen
                            and self._recent_skipped >= DORMANT_SKIP_SHARE * recent.maxlen and net <= 0
                            and self._coming(num_reqs) >= DORMANT_MIN_REQS)
            self._paying_checks = 0
        contexts = num_reqs if draftable is None else draftable()
        if net > 0 and caps is not None:
            # Caps only take candidates away, so they are read (a pass over
            # every request) only when drafting pays without them, and
            # change the verdict only where one binds.
            counts = level_counts(caps(), self.k)
            if counts[-1] < num_reqs:
                net, self.depth, _ = saved(counts)
        pays = net > 0
        self._since_skip += 1
        # Drafting is judged against the plain step, and no other model can
        # stand in for it: until it is trusted, plain steps come at the
        # probes' pace.
        explore = self._since_skip >= (EXPLORE_EVERY if _trusted(self.plain_cost) else PROBE_EVERY)
        probe_every = PROBE_EVERY
        if self._models_trusted():
            # Throughput one probe gives up, in plain steps' worth (counted as
            # a goodput shortfall per step alone, probes came 2-3x too often
            # at c=16).
            loss = max(0.0, -net) / plain
            probe_every = min(MAX_PROBE_EVERY, max(PROBE_EVERY, math.ceil(loss / PROBE_LOSS_BUDGET)))
        # A probe waits out steps that take in prompts (it would draft every
        # fresh request's first block at the dearest moment), up to another
        # probe gap (prompts may arrive on every step).
        due = self._skips_in_row + 1
        probe = due >= 2 * probe_every or (due >= probe_every and not self._takes_prompts())
        if ((pays and not explore) or probe) and contexts:
            self._skips_in_row = 0
            return self._drafts()
        self._skips_in_row = 0 if explore else self._skips_in_row + 1
        self._since_skip = 0
        return self._skip()

    def _model_error(self) -> float:
        """Mean relative error of the recent whole-step predictions (0 before any)."""
        errors = self._step_errors
        return sum(errors) / len(errors) if errors else 0.0

    def _skip(self) -> bool:
        self._remember(True)
        self.totals["skipped_steps"] += 1
        self.last.budget = 0
        return True

    def _drafts(self) -> bool:
        self._remember(False)
        return False

    def _remember(self, skipped: bool) -> None:
        recent = self._recent_skips
        if len(recent) == recent.maxlen:
            self._recent_skipped -= recent[0]
        recent.append(skipped)
        self._recent_skipped += skipped

    def admitted_without_context(self, n: int) -> None:
        """``n`` requests were admitted while dormant (metrics)."""
        self.totals["contextless_requests"] += n

    def ran_plain_step(self) -> None:
        """A step ran without speculation's paths, while dormant (metrics)."""
        self.totals["plain_steps"] += 1

    def _trace_blocks(self, pending, req_ids, num_verified, accepted) -> None:
        rows_of, raw, greedy, cal, _ = pending
        cal_rows = cal.float().cpu().tolist()
        for rid, n, a in zip(req_ids, num_verified, accepted):
            i = rows_of.get(rid)
            if i is not None and n:
                self._trace.block(self.steps, rid, greedy[i], raw[i], cal_rows[i], n, a)

    def _trace_costs(self) -> dict:
        # A trace's drafting cost is a whole K-deep block's (the simulator drafts those).
        par, walk = self.draft_cost.params, self.walk_cost.params
        if self._walk_known():
            par = CostParams(par.t0 + self.k * walk.t0, par.t_req + self.k * walk.t_req, par.t_tok)
        return {"spec": vars(self.cost.params), "plain": vars(self.plain_cost.params), "draft": vars(par)}

    def acceptance_ratio(self) -> float:
        """The skip rule's accepted over expected tokens on recent verified
        blocks (1 until there is evidence, and under policies that never
        skip; bounded, so a few unlucky blocks cannot lock drafting out)."""
        # The skip rule's last estimate: snapshots read it from another
        # thread, which must not recompute it.
        estimate = self._window.last
        return 1.0 if estimate is None else estimate[1]

    def _takes_prompts(self) -> bool:
        """This step runs prompt tokens (a step without drafts runs one token
        per decoding request)."""
        return not self._step_verifies and self._step_tokens > self._step_reqs

    def _models_trusted(self) -> bool:
        # The drafting model is measured by every probe. The verify-step model
        # may never be: when the best lengths are 0, a probe verifies nothing;
        # until it is trusted, the plain model stands in for it, which only
        # makes drafting look cheaper, so backing off is still safe.
        return _trusted(self.draft_cost)

    def request_caps(self, extra_args: list[dict | None], left: list[int | None] | None = None) -> list[int]:
        """Per-request verify caps: SamplingParams.extra_args' dspark_max_verify
        (validated at admission), and one less than the tokens ``left`` before
        the request's max_tokens (None: no limit): a step yields at most
        verified + 1 tokens, and verifying past max_tokens is wasted work."""
        caps = [int(ea.get(MAX_VERIFY_KEY, self.k)) if ea else self.k for ea in extra_args]
        if left is not None:
            caps = [c if n is None else max(0, min(c, n - 1)) for c, n in zip(caps, left)]
        return caps

    def snapshot(self) -> dict:
        """Everything /metrics and the periodic log show."""
        return {
            "steps": self.totals["steps"],
            "budget_tokens_total": self.totals["budget_tokens"],
            "last_budget": self.last.budget,
            "length_hist": list(self.totals["length_hist"]),
            "skipped_steps": self.totals["skipped_steps"],
            "contextless_requests": self.totals["contextless_requests"],
            "plain_steps": self.totals["plain_steps"],
            "dormant": self.dormant,
            "acceptance_ratio": self.acceptance_ratio(),
            "verified_blocks": self.totals["verified_blocks"],
            "accepted_tokens": self.totals["accepted_tokens"],
            "predicted_step_s": self.last.predicted_s,
            "measured_step_s": self.last.measured_s,
            "cost_model_mape": 100.0 * self._model_error() if self._step_errors else None,
            "cost_params": vars(self.cost.params),
            "plain_cost_params": vars(self.plain_cost.params),
            "draft_cost_params": vars(self.draft_cost.params),
            "walk_cost_params": vars(self.walk_cost.params),
            "depth_hist": list(self.totals["depth_hist"]),
            "calibration": ({m: c.state() for m, c in self.calibrators.items()}
                            if self.calibrators else None),
            "load": self._load._asdict() if self._load else None,
        }

    def close(self) -> None:
        for model in (self.cost, self.plain_cost, self.draft_cost, self.walk_cost):
            model.save()
        if self._trace is not None:
            self._trace.flush()


def _append_outcome(columns: tuple[list, list, list], key: int, verified: int, accepted: int) -> None:
    """One block's (row or slot, tokens verified, tokens accepted)."""
    columns[0].append(key)
    columns[1].append(verified)
    columns[2].append(accepted)


def _trusted(model: OnlineCostModel) -> bool:
    return model.pinned or model.observations >= MIN_OBSERVATIONS


def level_counts(caps: list[int], k: int) -> list[int]:
    """How many requests may verify position j (cap > j), for j < k."""
    hist = [0] * (k + 1)
    for c in caps:
        hist[min(max(c, 0), k)] += 1
    counts, above = [], len(caps)
    for j in range(k):
        above -= hist[j]
        counts.append(above)
    return counts


def admitted_levels(conf: list[float], rows: int, base_cost: float, token_cost: float,
                    max_step_time: float, max_tokens: int,
                    counts: list[int] | None = None) -> list[tuple[int, float]]:
    """ops.adaptive_lengths for ``rows`` requests with the same conditional
    confidences ``conf`` [K], in closed form: (tokens admitted, their
    survival) per position, up to the last admitted; ``counts[j]`` of the
    requests may verify position j (default: all).
    Candidates come level by level (every row's position j, then j + 1);
    adding one of survival a to n admitted with survival sum S raises goodput
    iff a * (base + token_cost * n) > token_cost * (rows + S), and both sides
    grow by a * token_cost per admission, so a level is admitted whole or not
    at all, except where a cap cuts it."""
    n, gain, surv = 0, 0.0, 1.0
    out = []
    limit = max_tokens
    if token_cost > 0 and math.isfinite(max_step_time):
        limit = min(limit, int(math.floor((max_step_time - base_cost) / token_cost + 1e-9)))
    for j, c in enumerate(conf):
        surv *= min(max(c, 0.0), 1.0)
        if surv <= 0 or surv * (base_cost + token_cost * n) <= token_cost * (rows + gain):
            break
        level = rows if counts is None else counts[j]
        take = min(level, limit - n)
        if take <= 0:
            break
        n, gain = n + take, gain + take * surv
        out.append((take, surv))
        if take < level:
            break
    return out
