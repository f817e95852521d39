"""Dormancy: when the engine runs as one without speculation.

Dormant once drafting was skipped on at least ``dormant_skip_share`` of the
last ``dormant_after_steps`` steps (a lone probe must not hold it off) and
would not pay now with every request drafted, by models that have seen
enough drafting to say so, at any batch size; or when the
exploration budget is spent (budget.py) and no next episode is due at once
(``heed``); and from the first step, until the
budget can price speculation against steps without it (not with a pinned
cost curve: the budget then stays out). While dormant, new
requests get no drafter context (the context ledger), and where the runner
can, steps run as vLLM's steps without speculation; the full rule runs every
``dormant_recheck_every`` steps (those between coast: coasting.py), and
each check that finds drafting would not pay at the batch size of the last
doubles the gap, up to ``dormant_recheck_max`` (after a forward the rule's
step costs several times what a coasting step adds: at the shortest gap it
was most of what a dormant step cost over vLLM's; docs/tuning.md); a check
that pays, a step at another batch size, or waking starts it over (a batch
swinging across a power of two is checked every ``dormant_recheck_every``
steps). Whether
dormancy ends is the controller's call (``heed``), from ``pays``
(``dormant_exit_checks`` checks in a row where drafting pays by more than
the cost models' recent error times what drafting and verifying cost:
ending it costs what no model sees, and a rule near break-even flips on
noise) and the budget. An episode the models did not
call for (they knew too little, or the budget re-tests their verdict) is a
trial: its first ``trial_steps`` steps with drafter context draft whatever
the models say, and the models' rule does not end it (the budget does); a
re-test that skipped on the verdict under test would measure nothing. So is
one they called for before the drafting model is trusted: their verdict
flips on a request's first few blocks, and an episode that then mostly
skipped paid the skipped steps' overhead and was booked as drafting's loss. Any
episode stays on trial while the budget measures it gaining on no
speculation (budget.py): where the models and the measurement disagree, the
measurement decides (docs/controller.md), with the gate's explore steps still
keeping the plain step measured.
"""

from collections import deque
from collections.abc import Callable

from vllm_dspark.controller.budget import ExplorationBudget
from vllm_dspark.controller.tuning import ControllerTuning


class Dormancy:
    def __init__(self, tuning: ControllerTuning, after_steps: int, budget: ExplorationBudget | None = None):
        """``budget``: the measured guard over the rule (None: the models'
        rule alone, as with a pinned cost curve)."""
        t = tuning
        self._share = t.dormant_skip_share
        self._recheck, self._exit_checks, self._record_every = (t.dormant_recheck_every, t.dormant_exit_checks,
                                                                 t.dormant_record_every)
        self.enabled = bool(after_steps)
        self.budget = budget if self.enabled else None
        # Whether the drafter was skipped, for the last after_steps steps, and how many skipped.
        self._recent: deque[bool] = deque(maxlen=max(1, after_steps))
        self._recent_skipped = 0
        self.dormant = self.guarded  # until the budget can price speculation
        self._cheap = 0  # steps skipped without the rule since it last ran
        self._max_recheck = max(t.dormant_recheck_max, self._recheck)
        self._gap = self._recheck  # steps between dormant checks now
        self._checked_class = 0  # the batch-size class (a power of two) of the last dormant check
        self._paying = 0  # checks in a row where drafting would pay
        self._plain = 0  # dormant plain steps finished (for record_every)
        self._trial_steps, self._price_at = t.trial_steps, t.trial_price_at
        self._trial = 0  # drafting steps the open exploring episode still takes whatever the models say
        self._trial_priced = False  # the open trial took its price steps

    def cheap_skip(self, rows: int, contextless: bool = False) -> int:
        """Dormant (or ``contextless``: no request of the step keeps drafter
        context, so it runs plain awake too), and the full rule is not due
        this step (dormant, at a batch size other than the last check's, it
        is ``dormant_recheck_every`` steps after that check): skip without it.
        Returns 0 (the rule is due), or how many steps from this one on may
        skip so before it is (a coasting run: coasting.py)."""
        gap = self._gap if self.dormant and rows.bit_length() == self._checked_class else self._recheck
        if (self.dormant or contextless) and self._cheap < gap - 1:
            self._cheap += 1
            return gap - self._cheap
        self._cheap = 0
        return 0

    def cheap_skipped(self, n: int) -> None:
        """``n`` steps of the run the last cheap_skip allowed skipped as well."""
        self._cheap += n

    def update(self, net: float, spend: float, model_error: float, settled: bool, rows: int) -> None:
        """The rule ran at ``rows`` requests: drafting would save ``net``
        seconds for ``spend`` (``settled``: by models that have seen enough
        drafting to say so)."""
        if self.dormant:
            self._paying = self._paying + 1 if net > model_error * spend else 0
        elif not self.on_trial(rows):
            recent = self._recent
            if (self.enabled and settled and len(recent) == recent.maxlen and net <= 0
                    and self._recent_skipped >= self._share * recent.maxlen):
                self.sleep()

    @property
    def pays(self) -> bool:
        """Dormant, and drafting paid beyond the models' error on the last checks."""
        return self._paying >= self._exit_checks

    @property
    def guarded(self) -> bool:
        return self.budget is not None

    def heed(self, curious: bool, building: float, rows: int, step: int) -> None:
        """The exploration budget's say at ``rows`` requests at engine step ``step`` (unguarded: the
        models' alone). An episode of speculation starts where the models say drafting pays
        (on credit, more where they are not ``curious``: budget.py), or,
        while the budget holds its reserve, where they know too little to say
        (``curious``), where the last episode lost and its loss is earned
        back, where the last one measured gained, or where the balance is
        full (re-testing a verdict that may be stale); it ends as soon as the budget is spent (``building``: the
        share of the batch without drafter context). One that ends where the next is due at once (what episodes
        there gained still funds it) goes on as that one, with no step between: a dormant step would run plain,
        and every request in it would lose its drafter context for good (at one request, the rest of it). A
        dormant engine's episode waits while the awake share there is unmeasured, for a while (awake.py)."""
        budget, was_dormant = self.budget, self.dormant
        if budget is None:
            if was_dormant:
                self._space(rows, False)
            if was_dormant and self.pays:
                self.wake()
            return
        if not was_dormant:
            if not budget.spent(building, rows):
                return
            self.sleep()
        if budget.episode_open:  # ended now, or since (by the models' rule)
            budget.close()
        pays = self.pays
        due = budget.full or budget.retest_due(rows) or budget.gained(rows)
        opens = budget.affords_episode(pays, rows) and (pays or curious or due)
        opens = opens and not (was_dormant and budget.awake.waits(rows, step))
        if was_dormant:
            self._space(rows, budget.awake.hurries(rows, step))
        if opens:
            sure = pays and not curious
            budget.open(sure, rows)
            self.wake()
            # Going on, the models decide: a trial would draft on through the stretch that just lost.
            self._trial = 0 if sure or not was_dormant else self._trial_steps
            self._trial_priced = False

    def _space(self, rows: int, hurry: bool) -> None:
        """A dormant check at ``rows`` requests: the next one further off while checks find nothing new,
        unless ``hurry`` (probes are wanted: awake.py)."""
        same = rows.bit_length() == self._checked_class and not self._paying
        self._gap = min(2 * self._gap, self._max_recheck) if same and not hurry else self._recheck
        self._checked_class = rows.bit_length()

    def lasts(self, building: float, rows: int) -> bool:
        """Awake, and the budget would not end the episode this step (heed)."""
        return not self.dormant and not (self.budget is not None and self.budget.spent(building, rows))

    def wake(self) -> None:
        self.dormant, self._paying, self._gap = False, 0, self._recheck
        self._recent.clear()
        self._recent_skipped = 0

    def sleep(self) -> None:
        self.dormant, self._paying, self._cheap, self._trial, self._gap = True, 0, 0, 0, self._recheck

    @property
    def exploring(self) -> bool:
        """An exploring episode's first ``trial_steps`` steps with context."""
        return not self.dormant and self._trial > 0

    def price_due(self, rows: int) -> bool:
        """Should the episode take an explore skip and price steps now (gate.py)?
        Once a trial, once it has drafted ``trial_price_at`` steps while the
        budget books it losing at ``rows`` requests: its price steps floor a
        price the machine left as it began (drift.py). A trial booked gaining
        has nothing a higher price would change, and skips none. And once an
        episode, at a batch above its price (budget.py: ``prices_above``)."""
        due = (self.exploring and not self._trial_priced and self._trial <= self._trial_steps - self._price_at
               and self.budget is not None and self.budget.losing(rows))
        self._trial_priced = self._trial_priced or due
        return due or (not self.dormant and self.budget is not None and self.budget.prices_above(rows))

    def gaining(self, rows: int) -> bool:
        """An episode is open that the budget measures gaining on no speculation at ``rows`` requests."""
        return not self.dormant and self.budget is not None and self.budget.gaining(rows)

    def on_trial(self, rows: int) -> bool:
        """An episode is open and drafts whatever the models say: exploring,
        or gaining at this batch size (where the models' rule cannot end it)."""
        return self.exploring or self.gaining(rows)

    def remember(self, skipped: bool) -> None:
        """This step did (not) skip drafting."""
        recent = self._recent
        if len(recent) == recent.maxlen:
            self._recent_skipped -= recent[0]
        recent.append(skipped)
        self._recent_skipped += skipped
        if not skipped and self._trial:
            self._trial -= 1

    def unrecorded(self, plain: bool, measured: Callable[[], bool]) -> bool:
        """Leave this step out of the cost models? While dormant, ``plain``
        steps are alike: one in ``dormant_record_every`` of those that do not
        coast is recorded, and every one at a batch the nospec model has not
        ``measured()`` (asked of dormant plain steps only; no episode starts
        there until it has: budget.py). A step that ran awake (a probe:
        awake.py) is recorded."""
        if not (self.dormant and plain) or not measured():
            return False
        self._plain += 1
        return self._plain % self._record_every != 0
