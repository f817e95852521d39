"""Coasting: the bookkeeping of plain steps, and the dormant engine's cheapest.

While dormant, a plain step like the one before it (nothing admitted,
nothing verified) between the rule's checks (``dormant_recheck_every``,
dormancy.py) only needs counting; so does one awake in which no request
keeps drafter context (a batch admitted dormant runs plain to its end
whatever the engine decides meanwhile: checked and recorded on every step,
its steps cost 200 us more than vLLM's at 16 requests, 4% of a step); and
so does one of a fresh engine's warm-up (costs.warm_up: its steps teach no
price, and the budget, which cannot price yet, would keep every one of them
recorded). The runner asks ``coasts`` before the step
and, where it does, runs vLLM's step without speculation and calls nothing
else of the controller: the step is not timed, recorded or checked, and at
the next step that does not coast, the coasted steps are booked at once
(totals, the gate's skip count, and the budget's share of what the nospec
model prices them at). In an engine a Python call costs about 1-2 µs after
the forward has flushed the caches (a coasting step took 22 µs of controller
time when it went through begin_step and end_step, and still about 40 µs
of the runner's and the controller's when it asked ``coasts``), so the
fewer, the closer such a step comes to one of an engine without
speculation: ``coasts`` answers with a run, the steps until the rule is
due, and the runner coasts the rest of it without asking while the batch
stays the same (no request admitted, resumed or finished, the same
requests and tokens), reporting them at its next call. Whether a
step coasts is a function of the step and of state every rank holds alike
(dormancy is agreed; the nospec model learns from rank 0's timings), so
under tensor parallelism every rank coasts on the same steps.

Now and then the step after a dormant check runs awake instead, without
drafts, timed against the run before the check (a probe: awake.py).

The clock times a run as one span (rank 0's). Where the run's batch stayed
the same and the step after it admits nothing (else the span may hold the
engine's idle time), the span's mean step teaches the nospec models too:
the steps the rule runs on, the only ones timed apart, cost about 10% more
than the steps that coast between them (bf16, 4 requests, Zen 4), and
priced against those alone, drafting at break-even looked like a gain.
"""

from collections.abc import Collection

from vllm_dspark.controller.budget import ExplorationBudget
from vllm_dspark.controller.context_ledger import ContextLedger
from vllm_dspark.controller.costs import StepCosts
from vllm_dspark.controller.dormancy import Dormancy
from vllm_dspark.controller.gate import DraftGate
from vllm_dspark.controller.plan import StepView
from vllm_dspark.controller.telemetry import Telemetry


class Coasting:
    """Plain steps' bookkeeping, and whether a dormant one coasts."""

    def __init__(self, enabled: bool, dormancy: Dormancy, budget: ExplorationBudget, ledger: ContextLedger,
                 gate: DraftGate, telemetry: Telemetry, costs: StepCosts):
        """``enabled``: the runner can run vLLM's plain step."""
        self.plain_steps = enabled
        self.enabled = enabled and telemetry.trace is None  # a trace wants every step
        self._dormancy, self._budget, self._ledger, self._gate, self._telemetry, self._costs = (
            dormancy, budget, ledger, gate, telemetry, costs)
        self.due: bool | None = None  # this step was asked, and the rule is due (None: not asked)
        self._coasted = 0  # steps coasted since the last booking
        self._batch = (0, 0)  # the last one's requests and tokens
        self._uniform = True  # every step coasted since the last booking had that batch
        self._booked: tuple[int, int, int] | None = None  # the last booking's uniform run: requests, tokens, steps
        self.last_run: tuple[int, int, float] | None = None  # the last timed run: requests, tokens, its mean step

    def coasts(self, plain_before: bool, req_ids: Collection[str], admits: bool, verifies: bool,
               finished: Collection[str], tokens: int, fast: int = 0) -> int:
        """Does this step coast? 0: no; n: yes, and so may the n - 1 steps
        after it, unasked, while their batch stays this one's (the runner's
        check). ``plain_before``: the step before ran plain; ``fast``: steps
        of the last run the runner coasted unasked."""
        dormancy = self._dormancy
        if fast:
            self._coasted += fast
            dormancy.cheap_skipped(fast)
        # Awake, a step coasts where no request keeps context: asked after the cheap checks (a
        # drafting step is not plain_before, and this walks the batch).
        plain = (self.enabled and plain_before and (self._budget.ready or self._costs.warming)
                 and not (admits or verifies or (dormancy.dormant and self._budget.awake.armed)))
        contextless = plain and not dormancy.dormant and self._ledger.all_without(req_ids)
        if not (plain and (dormancy.dormant or contextless)):
            self.due = None
            return 0
        run = dormancy.cheap_skip(len(req_ids), contextless)
        self.due = not run
        if not run:
            return 0
        ledger = self._ledger
        if finished:
            ledger.forget(finished)
        ledger.lose_all(req_ids)  # a resumed request recomputed without drafter context
        batch = (len(req_ids), tokens)
        self._uniform = self._uniform and (self._coasted == 0 or batch == self._batch)
        self._coasted += 1
        self._batch = batch
        return run

    @property
    def pending(self) -> int:
        """Steps coasted and not booked yet."""
        return self._coasted

    def book(self) -> int:
        """Book the steps coasted since the last call; how many."""
        n = self._coasted
        self._booked = (*self._batch, n) if n and self._uniform else None
        if n:
            self._coasted, self._uniform = 0, True
            totals = self._telemetry.totals
            totals.plain_steps += n
            totals.skipped_steps += n
            self._gate.skipped(n)
            self._budget.earn_alike(*self._batch, n)
        return n

    def timed(self, span: float, view: StepView) -> None:
        """The clock's span over the run just booked, ``view`` the step after it."""
        self.last_run = None
        if self._booked is not None and span > 0 and not view.new_req_ids:
            reqs, tokens, n = self._booked
            self._costs.observe_plain(reqs, tokens, span / n, n)
            self.last_run = (reqs, tokens, span / n)
        self._booked = None

    def probes(self, view: StepView) -> bool:
        """Dormant, does this step probe the awake path (awake.py)?"""
        probes = self._dormancy.dormant and self._budget.awake.probing(view.num_reqs, view.tokens)
        self._telemetry.totals.probe_steps += probes
        return probes

    def ran(self, view: StepView, checked: int | None = None) -> None:
        """A plain step ran (not coasting): no request in it keeps drafter
        context. ``checked``: the rule checked a dormant engine at this
        step (its count), after the run just timed: the next step may probe."""
        if checked is not None and self._dormancy.dormant:
            self._budget.awake.arm(checked, self.last_run)
        self._ledger.lose_all(view.req_ids)
        totals = self._telemetry.totals
        totals.contextless_requests += len(view.new_req_ids)
        totals.plain_steps += 1
