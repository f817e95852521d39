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
        self._unit: float | None = None  # the first canary's time
        self.factor = 1.0

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
        level = median(self._times)
        self._unit = self._unit or level
        self.factor = level / self._unit
        self._gap = max(self._every, math.ceil(level / (self._max_share * step))) if step > 0 else self._every
        return spent
