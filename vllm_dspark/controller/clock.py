"""Step timing: how long each step took, the engine's gap after it included.

The engine's work between two steps (the engine core taking in one step's
output and scheduling the next) grows with what that step produced, so a
verify step leaves a longer gap than a plain one. It is charged to the step
before it: a step's sample is held until the next step starts, then recorded
with that gap. A gap longer than ``max_engine_gap_s`` is idle time; the step
is charged its kind's usual gap (an EMA) instead.
"""

import time
from collections.abc import Callable
from typing import NamedTuple

from vllm_dspark.controller.tuning import ControllerTuning


class StepSample(NamedTuple):
    """One step, as the cost models learn from it."""

    reqs: int  # requests in the step
    tokens: int  # tokens the target ran
    verifies: bool  # its target step verified drafts
    seconds: float  # the whole step, gap after it included, queued-context writes excluded
    draft_seconds: float  # of which the drafting path
    drafted: int  # blocks drafted (0: none)
    walk_seconds: float = 0.0  # of draft_seconds, the Markov walk (0: not timed apart)
    depth: int = 0  # positions walked
    plain: bool = False  # ran without speculation (dormant, or no request keeps drafter context)
    draft_tokens: int = 0  # of tokens, drafts verified
    accepted: int = 0  # of those, accepted
    saved: float | None = None  # plain steps those saved the batch (budget.steps_saved; None: their mean)
    extra_seconds: float = 0.0  # queued-context writes, left out of seconds (the exploration budget pays them)
    recorded: bool = True  # goes into the cost models (else only counted, and earns the budget)

    def at_most(self, seconds: float) -> "StepSample":
        """The step as the exploration budget books it: no longer than
        ``seconds``, the cost models' stall bound (``outlier_ratio`` times
        their prediction for it), cut from its drafting part first. A stall
        (a GC pause, the OS's) would have hit a step without speculation as
        well, and charged whole it can cost more than a reserve
        (docs/tuning.md); a step that is always this slow still pays the
        bound on every step."""
        cut = self.seconds - seconds
        return self if cut <= 0 else self._replace(seconds=seconds, draft_seconds=max(self.draft_seconds - cut, 0.0))


class StepClock:
    def __init__(self, tuning: ControllerTuning, now: Callable[[], float] = time.perf_counter,
                 share: Callable[[list[float]], list[float]] | None = None):
        """``share``: rank 0's values for this rank's (tensor parallelism: rank_sync.py)."""
        self._now = now  # the simulator passes its own clock
        self.share = share
        self._max_gap, self._ema = tuning.max_engine_gap_s, tuning.gap_ema
        self._t_start: float | None = None
        self._t_end: float | None = None
        self._gap = {False: 0.0, True: 0.0}  # usual gap after a plain / a verify step
        self._held: StepSample | None = None
        self.span = 0.0  # seconds the steps before this one ran untimed (a coasting run), rank 0's

    def begin(self) -> StepSample | None:
        """A step starts; returns the step before it, complete with its gap
        (None when no step is held). Begun and not ended since, the clock
        times the steps between as one ``span`` (coasting.py)."""
        now = self._now()
        held, self._held = self._held, None
        self.span = now - self._t_start if held is None and self._t_start is not None else 0.0
        if held is not None:
            gap = now - self._t_end
            if gap < self._max_gap:
                self._gap[held.verifies] = self._ema * self._gap[held.verifies] + (1 - self._ema) * gap
            else:
                gap = self._gap[held.verifies]
            held = held._replace(seconds=held.seconds + gap)
        self._t_start = now
        return held if self.share is None else self._rank0(held)

    @property
    def holding(self) -> bool:
        """A step's sample waits for the next ``begin``."""
        return self._held is not None

    @property
    def idle(self) -> bool:
        """No step or span is being timed."""
        return self._t_start is None and self._held is None

    def agree(self, *values) -> tuple:
        """Rank 0's values (ints) for this rank's decisions. Under tensor parallelism
        a rank's confidences may differ from rank 0's in the last bit, and the
        drafter's collectives need every rank to run the same kind of step at
        the same depth. A collective: every rank calls it at the same points."""
        return values if self.share is None else tuple(round(v) for v in self.share([float(v) for v in values]))

    def _rank0(self, held: StepSample | None) -> StepSample | None:
        """The step as rank 0 timed it. Every rank calls this on every step (a collective)."""
        mine = (1.0, held.seconds, held.draft_seconds, held.walk_seconds,
                held.extra_seconds) if held is not None else (0.0,) * 5
        present, seconds, draft, walk, extra, self.span = self.share([*mine, self.span])
        if held is None or not present:
            return None
        return held._replace(seconds=seconds, draft_seconds=draft, walk_seconds=walk, extra_seconds=extra,
                             depth=held.depth if walk > 0 else 0)

    def end(self) -> float | None:
        """The step ends; its seconds since ``begin`` (None: none began)."""
        if self._t_start is None:
            return None
        self._t_end = now = self._now()
        start, self._t_start = self._t_start, None
        return now - start

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` just spent (the pace canary) out of the step begun."""
        if self._t_start is not None:
            self._t_start += seconds

    def hold(self, sample: StepSample) -> None:
        """Record ``sample`` at the next ``begin``, once the gap after it is known."""
        self._held = sample
