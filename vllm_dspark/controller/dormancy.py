"""Dormancy: a pure state machine over the gate's verdicts.

Dormant once drafting was skipped on at least ``dormant_skip_share`` of the
last ``dormant_after_steps`` steps (a lone probe must not hold it off), would
not pay now with every request drafted, and ``dormant_min_reqs`` or more
requests are about to run (a small batch's context costs little to keep).
While dormant, new requests get no drafter context (the context ledger), and
where the runner can, steps run as vLLM's steps without speculation; the full
rule runs every ``dormant_recheck_every`` steps. It ends after
``dormant_exit_checks`` checks in a row where drafting pays by more than the
cost models' recent error times what drafting and verifying cost (ending it
costs what no model sees: every new request's context queued again, and a
rule near break-even flips on noise), or where fewer than
``dormant_min_reqs`` requests are coming (nothing drafts while dormant, so a
model that is far off must not hold a light load).
"""

from collections import deque

from vllm_dspark.controller.tuning import ControllerTuning


class Dormancy:
    def __init__(self, tuning: ControllerTuning, after_steps: int):
        t = tuning
        self._share, self._min_reqs = t.dormant_skip_share, t.dormant_min_reqs
        self._recheck, self._exit_checks, self._record_every = (t.dormant_recheck_every, t.dormant_exit_checks,
                                                                 t.dormant_record_every)
        self._enabled = bool(after_steps)
        # Whether the drafter was skipped, for the last after_steps steps, and how many skipped.
        self._recent: deque[bool] = deque(maxlen=max(1, after_steps))
        self._recent_skipped = 0
        self.dormant = False
        self._cheap = 0  # steps skipped without the rule since it last ran
        self._paying = 0  # checks in a row where drafting would pay
        self._plain = 0  # dormant plain steps finished (for record_every)

    def cheap_skip(self) -> bool:
        """Dormant, and the full rule is not due this step: skip without it."""
        if self.dormant and self._cheap < self._recheck - 1:
            self._cheap += 1
            return True
        self._cheap = 0
        return False

    def update(self, net: float, spend: float, model_error: float, coming: int) -> None:
        """The rule ran: drafting would save ``net`` seconds for ``spend``."""
        if self.dormant:
            sure = net > model_error * spend or coming < self._min_reqs
            self._paying = self._paying + 1 if sure else 0
            self.dormant = self._paying < self._exit_checks
        else:
            recent = self._recent
            self.dormant = (self._enabled and len(recent) == recent.maxlen
                            and self._recent_skipped >= self._share * recent.maxlen and net <= 0
                            and coming >= self._min_reqs)
            self._paying = 0

    def remember(self, skipped: bool) -> None:
        """This step did (not) skip drafting."""
        recent = self._recent
        if len(recent) == recent.maxlen:
            self._recent_skipped -= recent[0]
        recent.append(skipped)
        self._recent_skipped += skipped

    def unrecorded(self, drafted: int, verifies: bool) -> bool:
        """Leave this step out of the cost models? While dormant, plain steps
        are alike: one in ``dormant_record_every`` is recorded."""
        if not self.dormant or drafted or verifies:
            return False
        self._plain += 1
        return self._plain % self._record_every != 0
