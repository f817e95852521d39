"""ExplorationBudget: what speculation has cost against no speculation,
measured, and how much exploring it may still spend.

The gate decides from models; this checks the outcome. Every recorded step
is priced twice: what it took (queued-context writes and the gap after it
included), and what a step without speculation would have taken for the same
output, from the cost models of plain steps (costs.py): its prompt and decode
tokens at this batch (``decode``, of decode steps alone, for a step without
prompt tokens; ``nospec`` else), plus a plain decode step for every step its
accepted drafts brought the batch's end nearer (``steps_saved``: its longest
request's, not the mean per request). The difference is the step's excess
(negative where speculation won). A step with prompt tokens the nospec
model cannot price (see below) is charged from below: its drafter time less
what its accepted drafts saved, never less than nothing (the prompt context
of a wave of new requests is written there); so is a step that verified no
drafts (its target ran a plain step's tokens: skipping steps at a batch
size between arrivals must not end an episode that gains), and a decode step
at fewer requests than the last priced one (a wave's tail), against that
step's price. A verifying decode step at more requests than the last priced
one (a burst of arrivals) is priced at what the episode's price steps
measured there (it takes them once: gate.py, drift.py); before they have,
it is charged from above, against that price, and never as a gain either.

Once ``budget_warmup_steps`` plain steps were seen (after the engine's
warm-up, which teaches no price: costs.py), the first decode step
priced at each batch size (a power of two) lifts the balance to one episode's
reserve there (a fresh engine, or one under a new load, explores at once:
a reserve is in decoded tokens, dearer at fewer requests; a grant, not an
earning, so it earns back no lost episode's loss), earns ``share`` of every
step's no-speculation time and pays every speculating step's excess, up to
``cap_steps`` plain steps' worth (winnings must not license a long loss after
the load changes). An episode of speculation starts while the balance holds
the reserve, ``episode_tokens`` decoded tokens' worth, or where the cost
models say drafting pays, on any balance not in debt, and only once what the
last episode at about this batch size (the same power of two) lost has been
earned back (the models may be wrong at one load and right at another);
that episode is due then, whatever the models say (their verdict rests on
the lost episode's few blocks, and nothing updates it while dormant), and
each further loss in a row there doubles what must be earned first, up to a
full balance. It ends once it has lost a reserve (overall, or at the batch
size of the step beyond what episodes there gained: a gain banked at one
request must not fund a loss at four; where an episode lost a reserve at a
batch size it did not open at, the next one ends there on a net loss over
``marked_steps`` priced steps until that is earned back: a wave's tail must
not fund a reserve lost in each next wave), plus, while its requests'
drafter context builds up, a credit of what it opened with, up to a reserve
at its batch size (the cap where the models were sure), scaled by the share
of the batch still without context; meanwhile a step verifies at most as
many drafts as that room is worth in decoded tokens (a verified token costs
no more than a decoded one). So over any stretch the
engine gives up about ``share`` of its time, plus a reserve and a credit per
batch size and one step's drafting, plus the nospec model's error, whatever
the other models believe. A step verifying drafts with prompt tokens the
nospec model has not seen lately, or at fewer requests, is not priced (its
bound is from below); enough of them in a row end the episode, so plain steps
measure it; none starts at a batch size the nospec model has not measured.
Lately: within ``budget_price_age_steps`` speculating steps of a plain step
(the machine drifts: a long episode ends once its price is that old). Within
that age a price is at the machine's pace now (pace.py), and within an
episode bounded by what its verify and price steps take (drift.py, awake.py).

What an episode measured is kept per batch size (a power of two): it is
gaining at the batch size of this step only (a gain banked at one request
must not keep drafting on at 16), and the next episode at a batch size where
one ended gaining is due whenever the engine is dormant there, whatever the
models say. What the episodes there gained, net of what later ones lost (up
to the cap), funds the next one, and is forgotten once spent (the runs
behind both: docs/controller.md).
"""

import math

from vllm_dspark.controller.awake import AwakeProbes
from vllm_dspark.controller.clock import StepSample
from vllm_dspark.controller.cost_model import OnlineCostModel
from vllm_dspark.controller.drift import EpisodeDrift
from vllm_dspark.controller.pace import MachinePace
from vllm_dspark.controller.tuning import ControllerTuning


class ExplorationBudget:
    def __init__(self, nospec: OnlineCostModel, tuning: ControllerTuning, decode: OnlineCostModel | None = None,
                 pace: MachinePace | None = None):
        """``decode``: the nospec model of decode steps alone (costs.py), which
        prices decoded tokens and decode steps (default: ``nospec``). Both
        learn in ``pace``'s units; priced at its factor now (pace.py) and at
        an episode's drift (drift.py; its floor's awake share: awake.py)."""
        self._nospec, self._decode, self._pace = nospec, decode or nospec, pace or MachinePace(tuning)
        self.awake = AwakeProbes(tuning)
        self.drift = EpisodeDrift(self._decode, self._pace, tuning)
        t = tuning
        self._share, self._cap, self._reserve = t.budget_share, t.budget_cap_steps, t.episode_tokens
        self._warmup, self._max_unpriced, self._max_age = (t.budget_warmup_steps, t.budget_unpriced_steps,
                                                           t.budget_price_age_steps)
        self.balance = 0.0  # seconds
        self._at_cap = False  # the balance reached its cap, nothing spent since
        self.excess = 0.0  # seconds speculation cost over no speculation, all steps so far
        self.nospec_seconds = 0.0  # what no speculation would have taken for everything so far
        self._unpriced = 0  # speculating steps in a row the nospec model could not price
        self._step = 0.0  # a recent plain decode step's seconds (0: no step priced yet)
        self._token = 0.0  # and per decoded token
        self._step_reqs = 0  # the batch size it was priced at
        self._credit = 0.0  # plain steps of debt the episode may run into while building context
        self._opened = 0.0  # the balance the last episode opened with
        self._episode: int | None = None  # the open episode's batch-size class (None: none open)
        self._min_gain_steps, self._marked_steps = t.trial_steps, t.marked_steps
        # The open episode's excess and priced speculating steps, per batch-size class.
        self._gain: dict[int, tuple[float, int]] = {}
        self._won: dict[int, float] = {}  # batch-size class -> seconds its last measured episode gained
        # Per batch-size class after a losing episode: (the balance it must regain, the losses in a row there).
        self._marks: dict[int, tuple[float, int]] = {}
        self._granted: set[int] = set()  # batch-size classes whose first reserve was granted

    @property
    def price(self) -> dict | None:
        """The last price of a plain decode step, and its batch size (None: none yet)."""
        return {"seconds": self._step, "requests": self._step_reqs} if self._step else None

    @property
    def ready(self) -> bool:
        """Can steps be priced (the nospec model has seen enough plain steps)?"""
        return self._decode.pinned or self._decode.observations >= self._warmup

    def settle(self, s: StepSample) -> None:
        """One recorded step (``s.plain``: it ran without speculation)."""
        self.awake.observe(s)  # a probe's, before the budget can price (a fresh engine's warm-up)
        if not self.ready:
            return
        if not s.plain:
            self.drift.observe(s)
        nospec = self._nospec
        decodes = self.measured(s.reqs)
        if decodes:  # the price of a decoded token at this batch
            self._step = self._decode_price(s.reqs)
            self._token, self._step_reqs = self._step / s.reqs, s.reqs
            if s.reqs.bit_length() not in self._granted:  # a batch size's first reserve is granted
                self._granted.add(s.reqs.bit_length())
                self._grant(self._reserve_seconds - self.balance)
        if s.plain:
            self._unpriced = 0
            self.earn(s.seconds)
            return
        prompts = s.tokens - s.draft_tokens > s.reqs
        saved = (s.accepted / s.reqs if s.saved is None else s.saved) * self._step
        if not (self._token and decodes and (not prompts or self._fresh(nospec, s.reqs, s.tokens - s.draft_tokens))):
            verified = s.draft_tokens > 0
            if self._token and verified and not prompts and s.reqs > self._step_reqs:
                # Above the last price: at the floor the episode's price steps measured up to here, gains
                # and all; without one, from above, never as a gain (that price is older, and noisy).
                took, here = s.seconds + s.extra_seconds, self.drift.above(self._step_reqs, s.reqs, self.awake.share_near)
                if here:
                    saved *= here / self._step
                    self._charge(here + saved, took - here - saved, s.reqs)
                    return
                excess = max(0.0, took - self._step - saved)
                self._charge(took - excess, excess, s.reqs, False)
                return
            self._unpriced += verified  # what the target spent on drafts is unknown: a loss may hide there
            if self._token and (prompts or s.reqs < self._step_reqs or not verified):
                # No baseline here, but a bound from below, never a gain (the module docstring).
                bounds = [s.draft_seconds] if prompts or not verified else []
                if not prompts and s.reqs < self._step_reqs:
                    bounds.append(s.seconds - self._step)
                excess = max(0.0, max(bounds) + s.extra_seconds - saved)
                self._charge(max(s.seconds + s.extra_seconds - excess, 0.0), excess, s.reqs, priced=False)
            return
        self._unpriced = 0
        baseline = (self._price(nospec, s.reqs, s.tokens - s.draft_tokens) if prompts else self._step) + saved
        self._charge(baseline, s.seconds + s.extra_seconds - baseline, s.reqs)

    def _charge(self, baseline: float, excess: float, reqs: int, priced: bool = True) -> None:
        """A speculating step of ``reqs`` requests took ``excess`` over the ``baseline`` of none."""
        self.excess += excess
        gained, steps = self._gain.get(reqs.bit_length(), (0.0, 0))
        self._gain[reqs.bit_length()] = (gained + excess, steps + priced)
        self._pay_in(baseline, self._share * baseline - excess)

    def _grant(self, lift: float) -> None:
        """Lift the balance by ``lift`` (if positive) without earning it: what a lost episode must earn back
        rises with it (a batch size seen for a step or two must not fund a re-test where one just lost)."""
        if lift <= 0:
            return
        self.balance += lift
        cap = self._cap_seconds
        self._marks = {c: (min(need + lift, cap), losses) for c, (need, losses) in self._marks.items()}

    def earn(self, seconds: float) -> None:
        """A plain step (left out of the models or not: dormant steps are alike)."""
        if self._step:
            self._pay_in(seconds, self._share * seconds)

    def earn_alike(self, reqs: int, tokens: int, steps: int) -> None:
        """Dormant plain steps left untimed (coasting.py), each of ``reqs``
        requests and ``tokens`` tokens: priced by the nospec models, which
        every rank holds alike."""
        if self._step:
            self.earn(steps * self._price(self._decode if tokens == reqs else self._nospec, reqs, tokens))

    @property
    def _cap_seconds(self) -> float:
        """The most the balance holds: ``cap_steps`` plain decode steps at the last price."""
        return self._cap * self._step

    @property
    def _reserve_seconds(self) -> float:
        """One episode's reserve: ``episode_tokens`` decoded tokens at the last priced batch."""
        return self._reserve * self._token

    def _decode_price(self, reqs: int) -> float:
        """A plain decode step's price at ``reqs``: within an episode no more
        than its verify steps there take, nor less than its price steps less
        the awake path's share (drift.py)."""
        price = self._price(self._decode, reqs, reqs)
        if self._episode is None:
            return price
        return min(max(price, self.drift.floor(reqs, self.awake.share(reqs))), self.drift.ceiling(reqs))

    def _price(self, model: OnlineCostModel, reqs: int, tokens: int) -> float:
        """Seconds a step without speculation takes now (the model learns in pace units)."""
        return model.params.predict(reqs, tokens) * self._pace.factor * self.drift.factor

    def _pay_in(self, baseline: float, amount: float) -> None:
        """A priced step: no speculation would have taken ``baseline``; the
        balance moves by ``amount``, gains up to the cap. A cap that fell with
        the step's price (fewer requests) does not cut what the balance holds."""
        self.nospec_seconds += baseline
        cap = self._cap_seconds
        if amount < 0:
            self._at_cap = False
            self.balance += amount
        elif self.balance + amount >= cap:
            self.balance, self._at_cap = max(self.balance, cap), True
        else:
            self.balance += amount

    def open(self, sure: bool, rows: int) -> None:
        """An episode starts. While its requests' drafter context builds up
        (requests admitted before it have none, and the batch pays for
        context before it drafts them all) it may run into debt: by up to the
        cap where models that have seen enough drafting say it pays
        (``sure``), else by what the balance holds now, up to a reserve at
        this batch (docs/controller.md)."""
        held = min(max(self.balance, 0.0), self._reserve_seconds)
        self._credit = self._cap if sure else held / self._step
        self._opened, self._episode, self._gain = self.balance, rows.bit_length(), {}
        self.drift.open(rows)

    @property
    def episode_open(self) -> bool:
        return self._episode is not None

    def close(self) -> None:
        """The episode ended. At each batch size where it was measured over
        ``trial_steps`` priced steps, or where earlier episodes gained, its
        result adds to what they gained (up to the cap); a batch size with a
        gain left is remembered as gaining. One that lost, or could not be
        priced, where nothing is gained marks its batch size (as does a
        reserve lost at another): the next episode there waits until the loss
        is earned back, twice that after two in a row, and so on. One that
        gained, then went unpriced (its price grew old), is due again once
        plain steps have measured it afresh."""
        for rows_class, (excess, steps) in self._gain.items():
            fund = self._won.get(rows_class, 0.0) - excess
            if rows_class != self._episode and -fund > self._reserve_seconds:
                self._mark(rows_class, self.balance - fund, -fund)  # lost a reserve where it did not open
            if steps < self._min_gain_steps and rows_class not in self._won:
                continue  # too short to measure, and no gain to draw on
            if fund > 0:
                self._won[rows_class] = min(fund, self._cap_seconds)
            else:
                self._won.pop(rows_class, None)
        unpriced = self._unpriced >= self._max_unpriced
        if (unpriced or self.balance < self._opened) and self._episode not in self._won:
            # An unpriced episode measured nothing: count it as a reserve lost.
            lost = max(self._opened - self.balance, self._reserve_seconds if unpriced else 0.0)
            self._mark(self._episode, self._opened, lost)
        else:
            self._marks.pop(self._episode, None)
        self._episode = None

    def _mark(self, rows_class: int, before: float, lost: float) -> None:
        """``lost`` at ``rows_class`` from a balance of ``before``: regain that, more for each loss in a row."""
        losses = self._marks.get(rows_class, (0.0, 0))[1]
        self._marks[rows_class] = (min(before + lost * (2 ** losses - 1), self._cap_seconds), losses + 1)

    def _unearned(self, rows_class: int | None) -> bool:
        """Did the open episode start before the last loss at ``rows_class`` (not its own) was earned back?"""
        need = self._marks.get(rows_class, (-math.inf,))[0]
        return rows_class != self._episode and self._opened + self._won.get(rows_class, 0.0) < need

    def affords_episode(self, pays: bool, rows: int) -> bool:
        """Can an episode start at ``rows`` requests? Only where the nospec
        model has measured decode steps of about that batch lately (else its
        steps go unpriced, and the episode ends having measured nothing); where
        the models say drafting pays on any balance not in debt, else on the
        reserve; either way only once what the last episode at about this
        batch size lost has been earned back. What the last measured episode
        there gained counts toward both: one that gained and then lost a
        reserve in a row (a request the drafter cannot follow) is due again
        at once."""
        need = 0.0 if pays else self._reserve_seconds
        funds = self.balance + self._won.get(rows.bit_length(), 0.0)
        return (self._token > 0 and self.measured(rows)
                and funds >= max(need, self._marks.get(rows.bit_length(), (need,))[0]))

    def prices_above(self, rows: int) -> bool:
        """Should the open episode take price steps at ``rows`` requests? Once, where it verifies at more
        requests than its price and the nospec model has not measured (drift.py: ``asks``)."""
        return (self._episode is not None and self._token > 0 and rows > self._step_reqs
                and not self.measured(rows) and self.drift.asks(self._step_reqs, rows, self.awake.share_near))

    def measured(self, rows: int) -> bool:
        """Have plain decode steps of about ``rows`` requests been measured lately?"""
        return self._fresh(self._decode, rows, rows)

    def _fresh(self, model: OnlineCostModel, reqs: int, tokens: int) -> bool:
        """Has ``model`` seen steps like this lately, and a plain step at all
        within ``budget_price_age_steps`` speculating steps?"""
        return model.idle <= self._max_age and model.covers(reqs, tokens)

    def retest_due(self, rows: int) -> bool:
        """The last episode at about ``rows`` requests lost, and what it must
        earn first has been earned: the next one is due."""
        return rows.bit_length() in self._marks and self.affords_episode(False, rows)

    def gaining(self, rows: int) -> bool:
        """The open episode's priced speculating steps at about ``rows``
        requests, at least ``trial_steps`` of them, took less than no
        speculation would have: measured, whatever the models say."""
        excess, steps = self._gain.get(rows.bit_length(), (0.0, 0))
        return self._episode is not None and steps >= self._min_gain_steps and excess < 0

    def losing(self, rows: int) -> bool:
        """The open episode's steps at about ``rows`` requests cost more than no speculation."""
        return self._episode is not None and self._gain.get(rows.bit_length(), (0.0, 0))[0] > 0

    def gained(self, rows: int) -> bool:
        """The last episode measured at about ``rows`` requests gained: the
        next one there is due once affordable."""
        return rows.bit_length() in self._won

    @property
    def full(self) -> bool:
        """The balance reached its cap and nothing was spent since (the cap
        follows a decoded step's price, which moves with its model: compared
        with it, a full balance flickered)."""
        return self._step > 0 and self._at_cap

    def _room(self, building: float) -> float:
        """What the episode may still lose: a reserve, and its credit for
        ``building`` (the share of the batch without drafter context: none
        once all have it), beyond what it opened with."""
        return self.balance - self._opened + self._allowance(building)

    def _allowance(self, building: float) -> float:
        """A reserve, and the credit for ``building`` (see _room)."""
        return self._reserve_seconds + self._credit * building * self._step

    def spent(self, building: float, rows: int | None = None) -> bool:
        """End the speculating episode? It has no room left, too many steps
        in a row could not be priced, or at about ``rows`` requests it has
        lost a reserve and its credit beyond what episodes there gained (a
        gain banked at one batch size must not fund a loss at another), or
        anything, where a loss is still to earn back (``_unearned``)."""
        if self._token <= 0:
            return False
        rows_class = rows.bit_length() if rows else None
        excess, steps = self._gain.get(rows_class, (0.0, 0))
        lost_here = excess - self._won.get(rows_class, 0.0)
        allowance = 0.0 if self._unearned(rows_class) and steps >= self._marked_steps else self._allowance(building)
        return self._room(building) < 0 or self._unpriced >= self._max_unpriced or lost_here > allowance

    def draft_tokens(self, building: float) -> int | None:
        """The most drafts one step may verify: the episode's room in decoded
        tokens (None: not priced yet)."""
        if self._token <= 0:
            return None
        return max(0, math.floor(self._room(building) / self._token))

    def loss_share(self) -> float | None:
        """What speculation cost over no speculation, as a share of the latter."""
        return self.excess / self.nospec_seconds if self.nospec_seconds > 0 else None


def steps_saved(accepted: list[int], left: list[int | None] | None) -> float:
    """The plain decode steps a step's ``accepted`` drafts (per request) saved
    its batch, given the tokens each request had ``left`` before its
    max_tokens: how much nearer its longest request came to its end, less
    the step itself. A batch runs until its longest request ends, and
    without new requests to take the places the others free (a closed batch:
    waves, an offline batch no larger than max_num_seqs), the drafts of
    requests that end sooner save it little (docs/controller.md). Lengths
    unknown, or the batch open (requests joined it: arrivals.py): the mean
    per request."""
    if not accepted:
        return 0.0
    if left is None or None in left:
        return sum(accepted) / len(accepted)
    after = max(max(n - 1 - a, 0) for n, a in zip(left, accepted))
    return max(max(left) - after - 1, 0)
