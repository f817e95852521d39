"""EpisodeDrift: what an episode's own verify steps say about its no-spec
price: how far the machine sped up since the episode began (``factor``),
the most a plain step can cost now (``ceiling``) and, from its price
steps, the least (``floor``).

The exploration budget prices a speculating step against the no-spec models,
which learn from plain steps only, and an episode runs none: its price holds
the pace of the plain steps before it. The machine drifts within the
episode: on the AMD EPYC Zen 4 host a live no-spec engine ran 3.5-7.5 ms a
token from wave to wave while a c=1 episode was priced from two plain steps
(4.79 ms), and booked 1.58 s gained where it gained 1.00 s; a capped engine
drafted 612 steps booking -0.3% and ran 0.905x its no-spec partner. The
canary (pace.py) was not trusted there. The verify steps are timed every
step, and the machine's pace moves them as it moves plain steps. So past an
episode's first ``drift_window`` verify steps at its batch size (context
still building, shapes running for the first time), the first
``drift_shape_steps`` steps of each shape (requests, tokens) set that
shape's reference time (their median), and the median of the last
``drift_window`` steps' times over their shapes' references is the factor
the price follows down, as far as ``drift_clip``, and never up: a verify
step can slow for speculation's own reasons (the drafter's work in the
caches, steps that stopped gaining), and a price that rose with it would
hide the loss it is there to measure; one that falls with a faster
machine books less gain, never more. Per shape, since a fitted line's
errors moved with the waves' mixes of verified drafts. The factor holds
until plain steps teach the decode model again: an episode that ends and
opens again with none between keeps it, its price as old as before. Only verifying decode
steps at the episode's batch size (its power of two) count: prompt tokens
are not a decode step's shape (docs/controller.md has the measurements).

The factor sees no change from before the episode's first steps, and a
price set in a slow spell just before is the commoner error: a fresh
engine's second request ran its plain steps at 4.26 ms a token where a
live no-spec engine beside it ran 3.58, and priced at that, drafting booked
2.84 s of gain over 22 waves that lost 0.13 s (1.024x; Zen 4, native bf16,
c=1). A verify step carries a plain step's tokens and its drafts, so it
costs no less than a plain step of as many requests: within an episode a
plain decode step is priced at no more than the least, over the shapes
verified at as many requests, of the median of each one's last
``drift_shape_steps`` (``ceiling``; the one-draft shape's, mostly: all
verify steps' median sat 1.3-1.6x above a plain step at c=1 there). The
price steps after an episode's explore skips (gate.py) are a shape of their
own: a decode step that neither verifies nor drafts, which runs the
awake engine's path (the target's aux hidden states for the drafter's
context, the speculative metadata; the rule's time taken out) and costs no
less than a dormant plain step, 2-3% more at c=1 on the Zen 4 host
(traced: 4.50 ms against 4.38 ms). Teaching the no-spec models, they would
price the episode that much high; as a ceiling, they bring a stale price
to within that of the machine's pace now. Nothing else raises a price
set in a fast spell, or one the machine left as the episode began (a 2x
slow spell began with a c=1 trial there, whose steps then booked a loss
against a price set before it, and the engine went plain while full K=3
gained): so their median, less what the awake path costs over a plain
step as probes measure it (awake.py), is also its ``floor``. At more
requests than the price's (arrivals overlapping under light load) the
highest floor measured at up to as many requests prices a step (``above``,
a step at more requests costs no less), and an episode takes price steps
once at a batch size without one (``asks``): priced from above at the
1-request price, steps at 2-3 requests that gained were booked as losses,
and ended episodes that gained at one request. A
shape's first ``drift_shape_steps // 2`` runs are its warm-up and stay out
of its reference time for the factor (a first run took 11-21 ms among
7-9 ms ones: costs.py). Times are in the pace's
units, so a trusted canary's correction is not counted twice. Under tensor
parallelism every rank sees rank 0's step times (clock.py), so every rank's
factor is alike.
"""

import math
from collections import deque
from collections.abc import Callable
from statistics import median

from vllm_dspark.controller.clock import StepSample
from vllm_dspark.controller.cost_model import OnlineCostModel
from vllm_dspark.controller.pace import MachinePace
from vllm_dspark.controller.tuning import ControllerTuning


class EpisodeDrift:
    def __init__(self, decode: OnlineCostModel, pace: MachinePace, tuning: ControllerTuning):
        """``decode``: the model whose price the factor corrects (budget.py)."""
        self._decode, self._pace = decode, pace
        self._window, self._per_shape, self._clip = tuning.drift_window, tuning.drift_shape_steps, tuning.drift_clip
        self._skip = self._per_shape // 2  # a shape's first runs left out of its reference
        self._min_priced = max(tuning.price_steps, 1)  # price steps that floor the price
        self._rows: int | None = None  # the batch-size class measured (None: none yet)
        self._anchor = -1  # the decode model's observations when measuring began
        self._seen = 0  # its steps so far
        self._reference: dict[tuple[int, int], list[float]] = {}  # (reqs, tokens) -> its first steps' times
        self._recent: deque[float] = deque(maxlen=self._window)  # the last steps' times over their reference
        self._factor = 1.0
        # reqs -> tokens -> the episode's last verify decode steps of that shape, and their median
        self._verified: dict[int, dict[int, deque[float]]] = {}
        self._ceilings: dict[int, dict[int, float]] = {}
        self._asked: set[int] = set()  # batch sizes this episode took price steps at above its price (asks)

    @property
    def factor(self) -> float:
        """How far the pace moved since the price was set: 1 once plain steps set it anew."""
        return self._factor if self._decode.observations == self._anchor else 1.0

    def open(self, rows: int) -> None:
        """An episode starts at ``rows`` requests. What was measured holds
        while its price does (no plain step taught the decode model since)
        at the same batch size: an episode that ends and opens again with no
        plain step between is priced as before."""
        if rows.bit_length() != self._rows or self._decode.observations != self._anchor:
            self._restart(rows.bit_length())
        self._verified.clear()
        self._ceilings.clear()
        self._asked.clear()

    def ceiling(self, reqs: int) -> float:
        """The most a plain decode step of ``reqs`` requests costs now: a
        verify step carries its tokens and more, so it costs no less. The
        least, over the shapes this episode verified at ``reqs``, of the
        median of their last ``drift_shape_steps`` (inf before any)."""
        return min(self._ceilings.get(reqs, {}).values(), default=math.inf)

    def floor(self, reqs: int, awake_share: float | None) -> float:
        """The least a plain decode step of ``reqs`` requests costs now: the
        median of this episode's last price steps there (at least
        ``price_steps`` of them), less the awake path's ``awake_share``
        (awake.py); 0 before, or while that share is unmeasured."""
        times = self._verified.get(reqs, {}).get(reqs, ())
        if awake_share is None or len(times) < self._min_priced:
            return 0.0
        return median(times) / (1.0 + awake_share)

    def above(self, low: int, reqs: int, share: Callable[[int], float | None]) -> float:
        """The least a plain decode step of ``reqs`` requests costs now,
        where the price is of ``low`` requests: the highest ``floor`` this
        episode measured at more than ``low`` and no more than ``reqs``
        requests (a step at more requests costs no less), capped by the
        ``ceiling`` at ``reqs``; 0 where none was measured. ``share``: the
        awake share at a batch size (awake.py)."""
        best = max((self.floor(r, share(r)) for r in self._verified if low < r <= reqs), default=0.0)
        return min(best, self.ceiling(reqs))

    def asks(self, low: int, reqs: int, share: Callable[[int], float | None]) -> bool:
        """Should the episode take price steps at ``reqs`` requests, priced
        at ``low``? Once an episode up to as many (an ask covers more
        requests, as its floor does), and only where the awake share is
        measured (a floor needs it)."""
        if any(low < r <= reqs for r in self._asked) or share(reqs) is None or self.above(low, reqs, share) > 0:
            return False
        self._asked.add(reqs)
        return True

    def _restart(self, rows: int | None) -> None:
        self._rows, self._anchor, self._seen, self._factor = rows, self._decode.observations, 0, 1.0
        self._reference.clear()
        self._recent.clear()

    def observe(self, s: StepSample) -> None:
        """A speculating step."""
        if self._decode.observations != self._anchor:  # plain steps priced it anew meanwhile
            self._restart(self._rows)
        price_step = not (s.verifies or s.drafted) and s.tokens == s.reqs  # gate.py
        if not (price_step or (s.verifies and s.tokens - s.draft_tokens == s.reqs)):
            return
        # The rule's time (a price step runs it) and the drafter's are speculation's, not the target's.
        target = max(s.seconds - s.draft_seconds, 1e-6)
        times = self._verified.setdefault(s.reqs, {}).setdefault(s.tokens, deque(maxlen=self._per_shape))
        times.append(target)
        if len(times) == self._per_shape:
            self._ceilings.setdefault(s.reqs, {})[s.tokens] = median(times)
        if price_step or self._rows is None or s.reqs.bit_length() != self._rows:
            return
        self._seen += 1
        if self._seen <= self._window:  # context still building, shapes running for the first time
            return
        seconds = target / self._pace.factor
        reference = self._reference.setdefault((s.reqs, s.tokens), [])
        if len(reference) < self._per_shape + self._skip:
            reference.append(seconds)
            if len(reference) == self._per_shape + self._skip:  # its first runs are its warm-up
                reference.append(median(reference[self._skip:]))  # kept last: the shape's reference time
            return
        self._recent.append(seconds / reference[-1])
        if len(self._recent) == self._window:
            self._factor = min(max(median(self._recent), 1.0 / self._clip), 1.0)
