"""MachinePace: how fast the machine runs now, against when it was first timed.

Machines of this kind drift: on one 2-core AMD host the median of 32 plain
decode steps ranged 2.1-5.0 ms within one run (log sd 0.21), in spells of
seconds to minutes. The exploration budget prices a speculating step against
plain steps measured earlier (an awake engine runs none), so a price taken in
a slow spell made a neutral episode look 50% ahead. A fixed canary (two
128x128 matmuls) drifts with the steps (correlation 0.85 over 32-step
windows there). Run after a forward it takes 120-170 us (an Intel Xeon
host), not the 30 us it takes warm, and an engine pays it unseen (the
clock leaves it out of its step): every 8 steps it cost a dormant engine
0.5% of its time at 4 requests. So it runs at most every
``pace_every_steps`` steps and at least as far apart as keeps its median
time within ``pace_share`` of the steps' time between canaries. The no-spec models
learn steps in seconds at the first reading's pace (seconds / ``factor``,
``factor`` the median of the last ``pace_window`` canaries over the first),
and the budget prices in seconds at today's ``factor``, so the drift
between the two cancels. The engine's first canary only sets up the
kernels: timed right after its set-up call, from a warm cache, it reads
fast against every later one, and the steps learned before the next one
would be priced high for the rest of the run (docs/controller.md).

The canary is believed only as far as the steps bear it out, on the machine
it runs on. On an Intel Xeon host its reading fell 16-20% in the middle of
an episode, and stayed there, while the steps ran as before: the price fell
with it, and a c=1 episode that saved 2 ms a step was booked as losing. A
busy process on one of its two cores slowed the steps by half there and the
canary not at all. So at each canary the level of the last ``pace_window``
(the mean of their logs, each within 40% of their median) is set, as its
distance from its mean over what the cost models remember, against how far
the steps since those canaries ran over the models' predictions (the models
follow the machine as fast): ``CanaryFit``. ``factor`` moves with the
canary's level as far as that fit's slope ``trust`` (0 to 1) says when it
moves: a canary that moves with the steps, as on the Zen 4 host, prices at
its level; one that moves alone leaves the prices as the steps measured
them. Until ``pace_min_fits`` canaries were set against steps, and where the
slope is within twice its standard error of 0, ``trust`` is 0.

Without a canary (the simulator, a GPU, where the host's pace is not the
step's) ``factor`` stays 1. Under tensor parallelism every rank takes rank 0's
canary time (``share``), so every rank prices alike.
"""

import math
import time
from collections import deque
from collections.abc import Callable
from statistics import median

import torch

from vllm_dspark.controller.tuning import ControllerTuning


class MachinePace:
    def __init__(self, tuning: ControllerTuning, canary: bool = False,
                 share: Callable[[list[float]], list[float]] | None = None,
                 now: Callable[[], float] = time.perf_counter, work: Callable[[], None] | None = None):
        """``canary``: time one (else ``factor`` stays 1); ``work``: the canary's work (tests)."""
        self._every = self._gap = tuning.pace_every_steps  # the fewest steps between canaries; the gap now
        self._max_share = tuning.pace_share
        self._times: deque[float] = deque(maxlen=tuning.pace_window)
        self._share, self._now = share, now
        self._work = (work or self._matmuls) if canary else None
        self._a = torch.full((128, 128), 0.5) if canary and work is None else None
        self._last: int | None = None  # the step count at the last canary
        self._ended = 0.0  # when it ended
        self._level: float | None = None  # the canaries' level (log, see tick)
        self._base: float | None = None  # its mean over about the steps the cost models remember
        self._forgetting, self._clip = tuning.cost.forgetting, tuning.pace_clip
        self._steps: deque[tuple[float, float]] = deque(maxlen=tuning.pace_window)  # per canary: steps' measured, predicted s
        self._measured = self._predicted = 0.0  # since the last canary
        self._fit = CanaryFit(tuning)
        self.factor = 1.0

    @property
    def trust(self) -> float:
        """How far the steps bear the canary out (0 to 1)."""
        return self._fit.trust

    def observe(self, measured: float, predicted: float) -> None:
        """A step the cost models predicted (``predicted``, before learning it) took
        ``measured`` seconds (rank 0's: every rank fits alike)."""
        self._measured += measured
        self._predicted += predicted

    def _matmuls(self) -> None:
        torch.mm(torch.mm(self._a, self._a), self._a)

    def tick(self, steps: int) -> float:
        """Time the canary if ``steps`` (a count every rank holds alike) says it
        is due; returns the seconds it took (0: not due), for the clock to leave
        out of the step's."""
        if self._work is None or (self._last is not None and steps - self._last < self._gap):
            return 0.0
        t0 = self._now()
        self._work()
        end = self._now()
        spent, last, self._last, ended, self._ended = end - t0, self._last, steps, self._ended, end
        if last is None:  # it sets up the kernels; the pace is read from the next canary on (module doc)
            return spent
        step = (t0 - ended) / (steps - last)  # the steps' mean seconds since the last canary
        mine = [spent, step]
        shared, step = mine if self._share is None else self._share(mine)  # rank 0's: every rank spaces alike
        self._times.append(shared)
        now_s = median(self._times)
        # The mean of the window's logs, each within pace_clip of its median: smoothed as the steps' are
        # (below), a cold canary's stray reading (2-3x its median) cut.
        mid, clip = math.log(now_s), self._clip
        level = sum(min(max(math.log(t), mid - clip), mid + clip) for t in self._times) / len(self._times)
        moved, self._level = (0.0 if self._level is None else level - self._level), level
        if self._base is not None and self._predicted > 0:
            self._steps.append((self._measured, self._predicted))
            self._fit.add(level - self._base, math.log(sum(m for m, _ in self._steps) / sum(p for _, p in self._steps)))
        fade = self._forgetting ** (steps - last)  # as the cost models forget the steps
        self._base = level if self._base is None else fade * self._base + (1 - fade) * level
        self._measured = self._predicted = 0.0
        self.factor *= math.exp(moved * self.trust)  # a move counts as far as it is trusted when it comes
        self._gap = max(self._every, math.ceil(now_s / (self._max_share * step))) if step > 0 else self._every
        return spent


class CanaryFit:
    """How far the steps bear the canary out: the slope of the steps' log
    distance from the cost models' predictions (y) on the canary level's log
    distance from its mean (x), one pair per canary, decayed by
    ``pace_fit_decay``; ``trust`` is that slope in [0, 1] where it clears twice
    its standard error (neighbouring pairs share a window of ``pace_window``
    canaries, so a window counts once), else 0."""

    def __init__(self, tuning: ControllerTuning):
        self._decay, self._min_fits, self._window = tuning.pace_fit_decay, tuning.pace_min_fits, tuning.pace_window
        self._sums = [0.0] * 6  # weight, x, y, xx, xy, yy
        self._fits = 0
        self.trust = 0.0

    def add(self, x: float, y: float) -> None:
        sums, d = self._sums, self._decay
        for i, v in enumerate((1.0, x, y, x * x, x * y, y * y)):
            sums[i] = d * sums[i] + v
        self._fits += 1
        w, sx, sy, sxx, sxy, syy = sums
        cxx, cxy, cyy = sxx - sx * sx / w, sxy - sx * sy / w, syy - sy * sy / w
        dof = w - 2 * self._window
        if self._fits < self._min_fits or dof <= 0 or cxx <= 1e-12:
            return
        slope = cxy / cxx
        spread = math.sqrt(max(cyy - slope * cxy, 0.0) * self._window / (dof * cxx))
        self.trust = min(max(slope, 0.0), 1.0) if slope > 2 * spread else 0.0
