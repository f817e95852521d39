"""DSparkController: each step, whether to draft, how deep, and how many
drafted tokens each request verifies. The runner and the simulator drive the
same six calls (plan.py); every decision is made here and flows one way
back as a StepPlan or verify lengths. The parts, one job each:

  clock      StepClock          how long each step took (rank 0's, under TP)
  costs      StepCosts          what the next step will cost (online models)
  acceptance AcceptanceModel    what drafted tokens are likely to yield
  policy     VerifyPolicy       the verify lengths (full / threshold / adaptive)
  gate       DraftGate          does drafting pay, at what depth; probes (adaptive)
  dormancy   Dormancy           when to run as an engine without speculation (adaptive)
  coasting   Coasting           plain steps: their bookkeeping; the dormant ones coast
  budget     ExplorationBudget  what speculation cost against none, measured
  ledger     ContextLedger      which requests keep drafter context
  arrivals   Arrivals           is the running batch closed (waves) or open (serving)
  pace       MachinePace        how fast the machine runs now (the budget's prices follow it)
  telemetry  Telemetry          totals, the snapshot, traces

Every input to a length is known before the drafts are looked at: the lengths
are non-anticipating and verification stays lossless (docs/controller.md).
"""

import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from vllm_dspark.config import DSparkKnobs
from vllm_dspark.controller.acceptance import AcceptanceModel
from vllm_dspark.controller.arrivals import Arrivals
from vllm_dspark.controller.budget import ExplorationBudget
from vllm_dspark.controller.clock import StepClock, StepSample
from vllm_dspark.controller.coasting import Coasting
from vllm_dspark.controller.context_ledger import ContextLedger
from vllm_dspark.controller.costs import StepCosts
from vllm_dspark.controller.dormancy import Dormancy
from vllm_dspark.controller.gate import DraftGate, level_counts
from vllm_dspark.controller.pace import MachinePace
from vllm_dspark.controller.plan import (NO_STEP, DraftBlocks, RequestView, StepPlan, StepTiming, StepView,
                                         VerifyOutcome)
from vllm_dspark.controller.policies import make_policy
from vllm_dspark.controller.telemetry import ControllerSnapshot, Telemetry
from vllm_dspark.controller.tuning import ControllerTuning


class DSparkController:
    def __init__(self, knobs: DSparkKnobs, block_len: int, *, tuning: ControllerTuning = ControllerTuning(),
                 fingerprint: str = "", cache_dir: Path | None = None, acceptance: AcceptanceModel | None = None,
                 plain_steps: bool = False, now: Callable[[], float] = time.perf_counter,
                 share: Callable[[list[float]], list[float]] | None = None, canary: bool = False):
        """``plain_steps``: vLLM's plain step can run; ``now``: the clock; ``share``: rank_sync.py; ``canary``: pace.py."""
        self.knobs, self.k, self.tuning = knobs, block_len, tuning
        self.policy, self.pace = make_policy(knobs, tuning), MachinePace(tuning, canary, share, now)
        self.costs = StepCosts(block_len, tuning, fingerprint, cache_dir if knobs.persist_cost_model else None,
                               price_walk=knobs.adaptive_depth, sized_block=knobs.depth_sized_block, pace=self.pace)
        if knobs.cost_curve:
            self.costs.pin(knobs.pinned_curve(), knobs.cost_curve, alone=True)
        self.acceptance = acceptance or AcceptanceModel(block_len, tuning, calibrate=knobs.calibration)
        self.gate = DraftGate(block_len, tuning, knobs.slo_tokens_per_s)
        self.budget = ExplorationBudget(self.costs.nospec, tuning, self.costs.decode, self.pace)
        # A pinned cost curve decides alone: no measured guard over it.
        self.dormancy = Dormancy(tuning, knobs.dormant_after_steps if self.policy.gates_drafting else 0,
                                 None if knobs.cost_curve else self.budget)
        self.ledger, self.arrivals = ContextLedger(), Arrivals()
        self.telemetry = Telemetry(block_len, knobs.trace_folder(), knobs.policy, knobs.log_every)
        self.clock = StepClock(tuning, now, share)
        self.coasting = Coasting(plain_steps, self.dormancy, self.budget, self.ledger, self.gate, self.telemetry, self.costs)
        self.steps, self.depth = 0, block_len  # steps recorded or counted; the walk depth of the last plan
        self._view, self._gained = NO_STEP, (0, 0, 0.0)  # this step's view; its drafts verified, accepted, saved
        self._plain_step, self._building = False, 1.0  # this step runs plain; share of the batch without context

    # -- the step, in order -------------------------------------------------
    def begin_step(self, view: StepView) -> StepPlan | None:
        """A step starts. The plan at once if it runs as vLLM's plain step; else None (``plan`` gives it)."""
        due, self.coasting.due = self.coasting.due, None
        self._count(self.coasting.book())
        self._record(self.clock.begin())
        self.clock.exclude(self.pace.tick(self.steps))
        self.costs.warm_up(view.req_ids)
        self.coasting.timed(self.clock.span, view)
        self._view, self._gained = view, (0, 0, 0.0)
        self.ledger.forget(view.finished_req_ids)
        self.arrivals.step(view)
        # A step in which no request keeps drafter context has no speculative work either.
        (self._plain_step,) = self.clock.agree(not view.verifies and (self.dormancy.dormant or (
            self.dormancy.enabled and not view.new_req_ids and self.ledger.all_without(view.req_ids))))
        self._plain_step = self._plain_step and not self.coasting.probes(view)  # a probe runs awake (awake.py)
        if not (self.coasting.plain_steps and self._plain_step):
            return None
        if view.num_reqs:  # no request in it keeps context; the rule still runs (it ends dormancy)
            self._skips(view.num_reqs, None, due)
            self.coasting.ran(view, self.steps if due else None)
        return StepPlan("plain", self.depth)

    def coasts(self, req_ids: Collection[str], admits: bool, verifies: bool, finished: Collection[str],
               tokens: int, fast: int = 0) -> int:
        """Asked before begin_step: does this step coast, and for how many steps (coasting.py)?
        Then the runner runs it plain, calling nothing else. ``fast``: steps coasted unasked since."""
        run = self.coasting.coasts(self._plain_step, req_ids, admits, verifies, finished, tokens, fast)
        if run and (self.clock.holding or self.clock.idle):  # the held sample, its gap now known; the run's span
            self._record(self.clock.begin())
        return run

    def observe(self, outcome: VerifyOutcome) -> None:
        """What verification did with last step's drafts."""
        self.telemetry.verified(outcome.num_verified, outcome.accepted)
        self._gained = (sum(outcome.num_verified), sum(outcome.accepted), self.arrivals.saved(outcome))
        self.telemetry.trace_blocks(self.steps, self.acceptance.observe(outcome, self._gained[2]), outcome)

    def plan(self, requests: RequestView) -> StepPlan:
        """Draft this step, how deep, and whose context to keep if not."""
        rows, gates = len(requests.req_ids), self.policy.gates_drafting
        if not gates:
            self._admit(requests)  # under every policy, a stale cached prefix admits without context
        # The last verdict holds while its batch runs on (gate.py) and its episode lasts.
        cruises = gates and self.gate.cruises(self._view, lambda: self.dormancy.lasts(self._building, rows))
        gated = gates and rows > 0 and (self._draft() if cruises else self._skips(rows, requests))
        # A step without KV slots for drafts (scheduler.py) skips: the engine slept as the last one ended.
        skips, self.depth = self.clock.agree(gated or not self._view.draft_slots, self.depth)
        return StepPlan("skip", self.depth, self.ledger.among(requests.req_ids)) if skips else StepPlan("draft", self.depth)

    def choose(self, blocks: DraftBlocks) -> list[int]:
        """Verify lengths [B] for this step's blocks."""
        caps, trace = self.ledger.zero_caps(blocks.req_ids, blocks.caps), self.telemetry.trace is not None
        drafted = [min(max(c, 0), blocks.conf_logits.shape[1], self.depth) for c in caps]  # none past the walk
        allowance = self.budget.draft_tokens(self._building) if self.dormancy.guarded else None
        whole = self.gate.whole and (allowance is None or allowance >= sum(drafted))  # verifies them all
        conf = None if whole and not trace else self.acceptance.calibrated(blocks.conf_logits, blocks.greedy)
        self.acceptance.remember(blocks, caps, self.steps, conf if trace else None, self.depth)
        lengths = list(self.clock.agree(*(drafted if whole else self.policy.lengths(conf, torch.tensor(
            drafted, dtype=torch.int32, device=conf.device), self.costs, self._view, self.depth, allowance).tolist())))
        self.gate.held(self._view, lengths, drafted)
        self.telemetry.chose(lengths, self.depth)
        return lengths

    def end_step(self, timing: StepTiming) -> None:
        busy, view = self.clock.end(), self._view
        if busy is None or view.num_reqs == 0:
            return
        recorded = not (self.telemetry.trace is None and self.budget.ready and self.dormancy.unrecorded(
            self._plain_step and not (timing.drafted or view.verifies), lambda: self.budget.measured(view.num_reqs)))
        walked = timing.drafted and timing.walk_seconds > 0
        self.clock.hold(StepSample(view.num_reqs, view.tokens, view.verifies, busy - timing.excluded_seconds,
                                   timing.draft_seconds - timing.excluded_seconds, timing.drafted,
                                   timing.walk_seconds if walked else 0.0, self.depth if walked else 0,
                                   self._plain_step and not timing.drafted, *self._gained,
                                   timing.excluded_seconds, recorded))
        if self.telemetry.log_due(self.steps):
            self.telemetry.log(self.snapshot())

    # -- the drafting rule (policy adaptive) ----------------------------------
    def _skips(self, rows: int, requests: RequestView | None, due: bool | None = None) -> bool:
        """Skip the drafter this step? ``requests`` None: a plain step, where no
        request has context (``due``: coasts found the rule due). Decided from
        past steps and this step's load only: non-anticipating. docs/controller.md."""
        gate, dormancy = self.gate, self.dormancy
        if not due and dormancy.cheap_skip(rows, requests is None):
            self._admit(requests)
            gate.skipped()
            return self._skip()
        estimate = self.acceptance.estimate()
        if estimate is None:
            dormancy.heed(True, self._building, rows, self.steps)
            self.depth = self.k
            contexts = self._admit(requests)
            return self._skip(counted=contexts > 0) if contexts == 0 or dormancy.dormant else self._draft()
        assessment = gate.assess(estimate, self.costs, self._view, rows, self.acceptance.worth())
        verdict = assessment.best()
        curious = not self.costs.draft.trusted
        dormancy.update(verdict.net, verdict.spend, self.costs.margin(), settled=not curious, rows=rows)
        dormancy.heed(curious, self._building, rows, self.steps)
        contexts = self._admit(requests)
        if dormancy.dormant or (dormancy.guarded and self.budget.draft_tokens(self._building) == 0):
            return self._skip()
        if verdict.net > 0 and requests is not None:
            # Caps only take candidates away: read (a pass) only where drafting pays without them.
            counts = level_counts(self.ledger.zero_caps(requests.req_ids, requests.caps()), self.k)
            if counts[-1] < rows:
                verdict = assessment.best(counts)
        self.depth = self.k if (deep := self.acceptance.window.deep_stale(self.steps)) else verdict.depth  # survival.py
        if gate.drafts(verdict.net, assessment.plain, contexts, self._view, self.costs, dormancy.exploring,
                       dormancy.gaining(rows), once=deep, price=dormancy.price_due(rows)):
            return self._draft()
        return self._skip(counted=contexts > 0)  # for want of context: no verdict on drafting

    def _admit(self, requests: RequestView | None) -> int:
        """This step's admissions, by this step's dormancy; requests with context."""
        if requests is None:
            return 0
        added, contexts = self.ledger.admit(*self._view.admitted, requests.req_ids, self.dormancy.dormant)
        self.telemetry.totals.contextless_requests += added
        self._building = 1.0 - contexts / len(requests.req_ids)
        return contexts

    def _skip(self, counted: bool = True) -> bool:
        if counted:
            self.dormancy.remember(True)
        self.telemetry.skipped()
        return True

    def _draft(self) -> bool:
        self.dormancy.remember(False)
        return False

    # -- bookkeeping ------------------------------------------------------------
    def _record(self, sample: StepSample | None) -> None:
        if sample is None:  # no step held
            return
        if sample.recorded:  # a shape's first run is the machine's warm-up: no model of that shape learns it (costs.py)
            predicted = self.costs.observe(sample, self.costs.first_run(sample))
            self.budget.settle(sample.at_most(self.tuning.cost.outlier_ratio * predicted))  # a stall's excess: clock.py
            self.telemetry.recorded(sample, predicted, self.steps, self.costs)
        else:  # alike dormant plain steps: counted, and what they took earned
            self.budget.earn(sample.seconds)
        self._count()

    def _count(self, steps: int = 1) -> None:
        before, self.steps, every = self.steps, self.steps + steps, self.tuning.save_every_steps
        if self.steps // every > before // every:
            self.close()

    def snapshot(self, unreported: int = 0) -> ControllerSnapshot:
        """What /metrics (read-only, from another thread), logs and benchmarks show; ``unreported``: coasted unasked."""
        return self.telemetry.snapshot(dormant=self.dormancy.dormant, acceptance=self.acceptance, costs=self.costs,
                                       load=self._view.load, budget=self.budget, coasted=self.coasting.pending + unreported)

    def close(self) -> None:
        self.costs.save()
        self.telemetry.flush()
