"""Arrivals: is the running batch closed or open?

Closed: its requests came together and none joined since (waves, an offline
batch no larger than max_num_seqs). It runs until its longest request ends,
so a draft is worth what it brought that end nearer (budget.steps_saved).
Open: requests join it while it runs (serving, an offline queue refilling
freed places). Each request's own steps are then what its drafts save: the
mean per request. Served at light Poisson load (native fp32, 64 tokens a
request), two requests often overlap, and valued as a closed batch, the
drafts of the one with fewer tokens left counted for nothing (in one run of
three an engine slept after 416 drafting steps where full K=3 ran 1.2x
no-spec).

A batch begins at a step in which every request is new; a request joins it
once it has run a step without admissions (a cohort admitted over a few
steps, prompts chunked or the engine stepping before the last request of a
wave arrived, stays closed).
"""

from vllm_dspark.controller.budget import steps_saved
from vllm_dspark.controller.plan import StepView, VerifyOutcome


class Arrivals:
    def __init__(self):
        self.open = False  # a request joined the running batch
        self._settled = False  # the batch ran a step without admissions since it began

    def step(self, view: StepView) -> None:
        new = len(view.new_req_ids)
        if new and new == len(view.req_ids):
            self.open = self._settled = False
        elif new:
            self.open = self.open or self._settled
        elif view.req_ids:
            self._settled = True

    def saved(self, outcome: VerifyOutcome) -> float:
        """The plain steps a verify step's accepted drafts saved its batch."""
        return steps_saved(outcome.accepted, None if self.open else outcome.left)
