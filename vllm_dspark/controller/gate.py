"""The drafting gate (policy adaptive): does drafting pay this step, how deep
should the Markov head walk, and when does a probe or a plain step run anyway.

Drafting pays when the tokens the best lengths for recent confidences would
gain are worth more engine time than drafting and verifying them costs. The
best lengths are the adaptive op's, in closed form for a batch of average
requests (``admitted_levels``); a gained token is valued at what a plain
decode step spends per token at the batch about to run. The same closed form,
cut at each depth d <= K, picks the walk depth that saves the most.

While drafting does not pay, probe steps draft anyway to keep the estimates
fresh, paced so that they give up about ``probe_loss_budget`` of the
throughput; while it pays, one step in ``explore_every`` skips, so the plain
step's cost stays measured (it is what drafting is judged against), and
once that is, ``price_steps`` more follow: the first skip verifies the last
drafts, the ones after it are decode steps of this engine now that neither
verify nor draft, which cap and floor the episode's no-spec price
(drift.py: priced from the plain steps before it, an episode on the AMD
EPYC Zen 4 host was off by up to 45% for 2,000 steps). A trial, which
drafts whatever the models say, takes an explore skip and its price steps
where dormancy.py asks, whether the plain model is trusted or not: its
verdict is the budget's, on that price; so does an episode at a batch size
above its price (budget.py).

A verdict that drafting pays holds, unasked, for the next ``cruise_every``
- 1 steps of the same batch (same requests, and the tokens its lengths
scheduled: no prompt work, no request ended); where its lengths verified
every drafted token, so do theirs, without the lengths being asked. At one
request the rule and the lengths took 190 us of a 5.8 ms drafting step (3%),
which full K=7 does not pay (docs/controller.md). A probe's verdict holds
for no step after it.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

from vllm_dspark.controller.costs import StepCosts
from vllm_dspark.controller.plan import StepView
from vllm_dspark.controller.policies import step_limits
from vllm_dspark.controller.tuning import ControllerTuning


class Verdict(NamedTuple):
    net: float  # seconds drafting saves this step (negative: what it loses)
    depth: int  # the walk depth that saves the most
    spend: float  # what drafting and verifying cost at that depth


class Assessment:
    """One step's inputs to the gate, priced once; ``best`` may then be asked
    with and without the requests' caps."""

    def __init__(self, k: int, estimate: tuple[list[float], float], costs: StepCosts, view: StepView,
                 rows: int, slo: float | None, worth: float = 1.0):
        mean_surv, ratio = estimate
        est = costs.predict(rows, view.prefill_tokens, k)
        self.k, self.rows, self.plain = k, rows, est.plain
        self._base, self._draft_k, self._per_token = est.base, est.draft, est.per_token
        self._limits = step_limits(view, rows, slo)
        surv = [min(1.0, s * ratio) for s in mean_surv]
        self._levels = [s / p if p > 0 else 0.0 for s, p in zip(surv, [1.0, *surv[:-1]])]
        # What the workload made an accepted draft worth (acceptance.py); a
        # user's pinned curve decides alone, as its margin does (costs.py).
        self._value = costs.token_value(view.coming(rows)) * (1.0 if costs.alone else worth)
        self._shallow = costs.walk_priced()
        self._walk = costs.walk.params.predict(rows, 0) if self._shallow else 0.0

    def best(self, counts: list[int] | None = None) -> Verdict:
        """The depth that saves the most (ties: the deeper walk, more to learn
        from). The levels admitted at depth K are cut at each depth: a
        shallower walk makes the step cheaper, which would admit a level less
        only where it barely pays either way. ``counts[j]`` of the requests
        may verify position j (default: all)."""
        k, base = self.k, self._base
        taken = admitted_levels(self._levels, self.rows, base + self._draft_k, self._per_token, *self._limits, counts)
        best, n, gain = None, 0, 0.0
        for depth in range(1, k + 1):
            if depth <= len(taken):
                take, level_surv = taken[depth - 1]
                n, gain = n + take, gain + take * level_surv
            if depth == k or self._shallow:
                spend = base - self.plain + self._draft_k - self._walk * (k - depth) + self._per_token * n
                net = gain * self._value - spend
                if best is None or net >= best.net:
                    best = Verdict(net, depth, spend)
        return best


class DraftGate:
    def __init__(self, block_len: int, tuning: ControllerTuning, slo_tokens_per_s: float | None):
        self.k, self.slo = block_len, slo_tokens_per_s
        t = tuning
        self._probe_every, self._max_probe_every = t.probe_every, t.max_probe_every
        self._budget, self._explore_every = t.probe_loss_budget, t.explore_every
        self._price_steps = t.price_steps
        self._pause = 0  # skips still due after an explore skip (its price steps)
        self._skips_in_row = 0  # skipped steps since the last drafting one
        self._since_skip = 0  # steps since the last skip
        self._cruise_every = t.cruise_every
        self._cruise = _NO_CRUISE
        self._pays = False  # this step's verdict: drafting pays (not a probe)
        self.cruising = False  # this step drafts on the last verdict

    def assess(self, estimate, costs: StepCosts, view: StepView, rows: int, worth: float = 1.0) -> Assessment:
        """``worth``: an accepted draft's share of a decoded token (AcceptanceModel.worth)."""
        return Assessment(self.k, estimate, costs, view, rows, self.slo, worth)

    def cruises(self, view: StepView, allowed: Callable[[], bool]) -> bool:
        """Does the last verdict hold this step unasked (``allowed()``: the
        caller has no reason to ask)? Only for the batch it was made for, with
        the tokens its lengths scheduled."""
        left, req_ids, tokens, whole = self._cruise
        self.cruising = bool(left) and view.tokens == tokens and view.req_ids == req_ids and allowed()
        if self.cruising:
            self._cruise = _Cruise(left - 1, req_ids, tokens, whole)
            self._since_skip += 1
            self._skips_in_row = 0
        else:
            self._cruise, self._pays = _NO_CRUISE, False
        return self.cruising

    @property
    def whole(self) -> bool:
        """This step holds a verdict whose lengths verified every drafted token: so do its."""
        return self.cruising and self._cruise.whole

    def held(self, view: StepView, lengths: list[int], drafted: list[int]) -> None:
        """This step verifies ``lengths`` of its ``drafted`` tokens per
        request. A verdict that drafting pays holds for the next
        ``cruise_every`` - 1 steps, with its lengths where they verified
        every drafted token (one at least)."""
        whole = lengths == drafted
        if self.cruising:
            left, whole = self._cruise.left, whole and self._cruise.whole
        else:
            left = self._cruise_every - 1 if self._pays else 0
        self._cruise = (_Cruise(left, view.req_ids, len(view.req_ids) + sum(lengths), whole)
                        if left and any(lengths) else _NO_CRUISE)

    def skipped(self, steps: int = 1) -> None:
        """Steps skipped without the rule (dormant, or no request with context): a probe falls due as it would have."""
        self._skips_in_row += steps

    def drafts(self, net: float, plain: float, contexts: int, view: StepView, costs: StepCosts,
               trial: bool = False, gaining: bool = False, once: bool = False, price: bool = False) -> bool:
        """Draft this step, given what drafting would save (``net``), a plain
        step's cost and how many requests have drafter context? On ``trial``
        (an exploring episode's first steps, dormancy.py) whatever ``net``
        says, but for an explore skip and its price steps where ``price``
        (dormancy.py: the trial's verdict rests on its price, which they
        floor: drift.py); where the budget measures the episode ``gaining``,
        as if it paid (the explore steps still run: a measured gain holds
        only while the plain step it is judged against stays measured).
        ``once``: the step
        walks deeper than the verdict (a whole walk that keeps the deep
        positions measured: survival.py), so its verdict holds for no step
        after it: held, each such walk ran 8 steps 7 deep, a quarter of all
        steps at c=1 (Intel, capped fp32), where the verdict said 4-5."""
        pays = net > 0 or gaining
        self._since_skip += 1
        # Drafting is judged against the plain step, and no other model can
        # stand in for it: until it is trusted, plain steps come at the probes' pace.
        explore = self._pause > 0 or price or self._since_skip >= (
            self._explore_every if costs.plain.trusted else self._probe_every)
        probe_every = self._probe_every
        # The drafting model is measured by every probe; the verify-step model
        # may never be (when the best lengths are 0, a probe verifies nothing).
        if costs.draft.trusted:
            # Throughput one probe gives up, in plain steps' worth.
            loss = max(0.0, -net) / plain
            probe_every = min(self._max_probe_every, max(self._probe_every, math.ceil(loss / self._budget)))
        # A probe waits out steps that take in prompts (it would draft every
        # fresh request's first block at the dearest moment), up to another
        # probe gap (prompts may arrive on every step).
        due = self._skips_in_row + 1
        probe = due >= 2 * probe_every or (due >= probe_every and not view.takes_prompts)
        if ((pays and not explore) or probe or (trial and not (self._pause or price))) and contexts:
            self._skips_in_row, self._pause = 0, 0
            self._pays = ((pays and not explore) or trial) and not once
            return True
        self._skips_in_row = 0 if explore else self._skips_in_row + 1
        # At the explore pace ``price_steps`` more skips follow: the first skip verifies the last
        # drafts, the ones after it are decode steps without drafts, which cap the price (drift.py).
        self._pause = self._pause - 1 if self._pause else (
            self._price_steps if explore and (costs.plain.trusted or price) else 0)
        self._since_skip = 0
        return False


class _Cruise(NamedTuple):
    left: int  # steps the verdict may still hold
    req_ids: tuple[str, ...]  # its batch
    tokens: int  # the tokens its lengths scheduled for the next step
    whole: bool  # its lengths verified every drafted token


_NO_CRUISE = _Cruise(0, (), 0, False)


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
