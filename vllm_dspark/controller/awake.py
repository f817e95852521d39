"""AwakeProbes: what a step costs an awake engine over a plain one, measured.

An episode's price steps (gate.py) are decode steps that neither verify nor
draft, timed while the episode runs: the machine's pace now. They run the
awake engine's path (the target's aux hidden states, the speculative
metadata, the controller's whole step), which a dormant plain step, coasting,
does not: 10-14% more at 1-4 requests and 21% at 16 on the AMD EPYC Zen 4
host (bf16; each the upper quartile of 8 probes), and it differs by machine
and batch. To floor an episode's price at what its price steps say
(drift.py), that share must come out. So while dormant, now and then the
step after one of the rule's checks runs awake, without drafts (a probe);
its time over the mean step of the coasting run just before the check, at
the same batch, is one sample of the awake share at that batch size (a
power of two). Adjacent steps: the machine's drift, which moves plain steps
by tens of per cent from wave to wave on that host, falls on both. Probes
come at every check until ``awake_probe_window`` are in, then at most one
in ``awake_probe_every`` steps; a probe costs the awake share of one step.
Until ``awake_probe_window // 2`` are in, the share is unknown and nothing
floors the price (a share taken too low would floor it too high); after, it
is the upper quartile of the last window's. While a batch size's share is
unmeasured, no episode opens there and its dormant checks stay at their
shortest gap, each arming a probe (dormancy.py), so the share comes within
a few checks (spreading out, they took hundreds of steps): a fresh engine's
first trial at a batch size is the episode a slow spell, or a price that
drifted low, books as a loss unless the floor corrects its price. The wait
is one for the whole engine, ``awake_wait_steps`` engine steps from the
first episode it held off, however many batch sizes wait (where runs of
decode steps are too rare to probe, speculation must still start: it then
runs unfloored); outside it, a batch size's checks stay close for at most
``awake_probe_window`` of them. Every input is a step count or rank 0's
timing: under tensor parallelism every rank probes (and waits) on the same
steps.
"""

from collections import deque

from vllm_dspark.controller.clock import StepSample
from vllm_dspark.controller.tuning import ControllerTuning


class AwakeProbes:
    def __init__(self, tuning: ControllerTuning):
        self._every, self._window = tuning.awake_probe_every, tuning.awake_probe_window
        self._wait = tuning.awake_wait_steps if self._window else 0
        self._wait_from: int | None = None  # the engine step of the first episode held off (waits)
        self._shares: dict[int, deque[float]] = {}  # batch-size class -> the last probes' shares
        self._last = -self._every  # the step of the last probe
        self._armed: tuple[int, int, float] | None = None  # the next step probes: its batch, the run's mean step
        self._probe: tuple[int, int, float] | None = None  # this step probes, or the last did (not recorded yet)
        self._hurried: dict[int, int] = {}  # batch-size class -> dormant checks held close for its share

    def arm(self, step: int, run: tuple[int, int, float] | None) -> None:
        """A dormant check ran at engine step ``step`` after a coasting run of
        ``run`` (requests, tokens, mean seconds a step; None: not uniform, or
        prompt work followed it): the next step probes if one is due there."""
        if not self._window or run is None or run[0] != run[1]:  # decode steps only
            return
        have = len(self._shares.get(run[0].bit_length(), ()))
        if have < self._window or step - self._last >= self._every:
            self._armed, self._last = run, step

    @property
    def armed(self) -> bool:
        """The next step may probe: it must not coast (coasting.py)."""
        return self._armed is not None

    def probing(self, reqs: int, tokens: int) -> bool:
        """Does this step (dormant, plain by the rule) probe? Only at the batch it was armed for."""
        armed, self._armed = self._armed, None
        if armed is None or armed[:2] != (reqs, tokens):
            return False
        self._probe = armed
        return True

    def observe(self, s: StepSample) -> None:
        """A recorded step: the probe's, if one ran (the first recorded after it)."""
        probe, self._probe = self._probe, None
        if probe is None or s.plain or s.verifies or s.drafted or (s.reqs, s.tokens) != probe[:2]:
            return
        target = s.seconds - s.draft_seconds  # the rule's time is speculation's, as in a price step
        self._shares.setdefault(s.reqs.bit_length(), deque(maxlen=self._window)).append(target / probe[2] - 1.0)

    def waits(self, reqs: int, step: int) -> bool:
        """An episode would open at about ``reqs`` requests at engine step
        ``step``: hold it off? While the share there is unmeasured, within
        ``awake_wait_steps`` of the first episode held off."""
        if not self._wait or self.share(reqs) is not None:
            return False
        if self._wait_from is None:
            self._wait_from = step
        return self._waiting(step)

    def _waiting(self, step: int) -> bool:
        return self._wait_from is not None and step - self._wait_from < self._wait

    def hurries(self, reqs: int, step: int) -> bool:
        """A dormant check at about ``reqs`` requests at engine step ``step``:
        keep the next one at the shortest gap? While the share there is
        unmeasured: throughout the wait (waits), else for at most
        ``awake_probe_window`` checks (where runs of decode steps are too
        rare to probe, the checks then spread out as before probes)."""
        c = reqs.bit_length()
        if not self._window or self.share(reqs) is not None:
            return False
        if self._waiting(step):
            return True
        hurried = self._hurried.get(c, 0)
        if hurried >= self._window:
            return False
        self._hurried[c] = hurried + 1
        return True

    def share(self, reqs: int) -> float | None:
        """What an awake step without drafts costs over a plain one at about
        ``reqs`` requests, as a share (None: not measured yet)."""
        shares = sorted(self._shares.get(reqs.bit_length(), ()))
        if len(shares) < max(self._window // 2, 1):
            return None
        return max(shares[(3 * len(shares)) // 4], 0.0)

    def share_near(self, reqs: int) -> float | None:
        """The share at about ``reqs`` requests, else at the largest batch size
        below it measured (None: neither). Light arrivals rarely leave a
        dormant run at two requests to probe; from one to four requests the
        share stayed within 10-14% here, so one request's stands in."""
        for k in sorted((k for k in self._shares if k <= reqs.bit_length()), reverse=True):
            share = self.share(1 << (k - 1))
            if share is not None:
                return share
        return None

    def state(self) -> dict:
        """Per batch size (its class's fewest requests): the share now and the probes behind it."""
        out = {}
        for c, shares in sorted(self._shares.items()):
            share = self.share(1 << (c - 1))
            out[str(1 << (c - 1))] = {"share": None if share is None else round(share, 4), "probes": len(shares)}
        return out
