"""The messages between the runner (or the simulator) and the controller.

A step, in the order both drive it (docs/controller.md):

    coasts(req_ids, ...)     -> True: the step runs plain and nothing else
                                is called (a dormant engine's alike steps)
    begin_step(StepView)     -> StepPlan("plain") when the step runs as one
                                without speculation, else None
    observe(VerifyOutcome)      what verification did with last step's drafts
    plan(RequestView)        -> StepPlan("draft" | "skip", depth, contextless)
    choose(DraftBlocks)      -> verify length per drafted block
    end_step(StepTiming)

Decisions flow one way: nothing here calls back into the runner, and what the
controller needs to know about requests arrives in the view or through
``RequestView``. The per-step messages are NamedTuples: immutable, and built
on every step, where a frozen dataclass costs about twice as much.
"""

from typing import NamedTuple, Protocol

import torch

from vllm_dspark.config import MAX_VERIFY_KEY
from vllm_dspark.controller.signals import LoadSignals, load_of, prefill_tokens


class StepView(NamedTuple):
    """What the scheduler gave this step, as the controller reads it."""

    req_ids: tuple[str, ...]  # the requests scheduled this step
    new_req_ids: tuple[str, ...]  # of those, the ones admitted this step
    finished_req_ids: frozenset[str] | tuple[str, ...]  # requests that ended since the last step
    load: LoadSignals | None  # the scheduler's queue and budget (None: not a DSparkScheduler)
    tokens: int  # tokens the target runs this step (decodes, verified drafts, prompt chunks)
    prefill_tokens: int  # prompt tokens among them, counted only while prompts wait (else 0)
    verifies: bool  # the step verifies drafts made on the step before
    stale_ids: frozenset[str] = frozenset()  # new requests whose cached prefix lacks drafter context

    @classmethod
    def of(cls, scheduler_output, stale_ids: frozenset[str] = frozenset()) -> "StepView":
        load = load_of(scheduler_output)
        new = scheduler_output.scheduled_new_reqs
        return cls(
            tuple(scheduler_output.num_scheduled_tokens),
            tuple(r.req_id for r in new) if new else (),
            scheduler_output.finished_req_ids,
            load,
            int(scheduler_output.total_num_scheduled_tokens),
            # A pass over every request: only while prompts wait (the prompt
            # work expected next to the coming decodes; none once the queue is
            # empty, so the last chunk of a burst does not make drafts look cheap).
            prefill_tokens(scheduler_output) if load is None or load.waiting > 0 else 0,
            bool(scheduler_output.scheduled_spec_decode_tokens),
            stale_ids,
        )

    @property
    def admitted(self) -> tuple[tuple[str, ...], frozenset[str]]:
        """The new requests, and those of them whose cached prefix lacks drafter context."""
        return self.new_req_ids, self.stale_ids

    @property
    def draft_slots(self) -> bool:
        """The scheduler reserved KV slots for this step's drafts (scheduler.py)."""
        return self.load is None or self.load.draft_slots

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def takes_prompts(self) -> bool:
        """The step runs prompt tokens (a step without drafts runs one token per decode)."""
        return not self.verifies and self.tokens > len(self.req_ids)

    def coming(self, rows: int) -> int:
        """The batch about to run: every admitted or queued request, up to
        max_num_seqs, and at least this step's ``rows``."""
        load = self.load
        if load is None:
            return rows
        queued = load.running + load.waiting
        return max(rows, min(queued, load.max_running) if load.max_running else queued)


NO_STEP = StepView((), (), (), None, 0, 0, False)


class StepPlan(NamedTuple):
    """What the runner enacts."""

    mode: str  # "plain": vLLM's step without speculation; "skip": no drafter, context queued; "draft"
    depth: int  # positions the Markov head walks when drafting (1..K)
    contextless: frozenset[str] = frozenset()  # skip: this step's requests whose context is not queued


class RequestView(Protocol):
    """This step's requests, in batch row order, as the controller may ask about them."""

    req_ids: list[str]

    def caps(self) -> list[int]:
        """Each row's verify cap (``request_caps``), computed on first call
        only: it is a pass over every request."""


class DraftBlocks(NamedTuple):
    """This step's drafted blocks, one row per request."""

    req_ids: list[str]
    conf_logits: torch.Tensor  # [B, K] raw confidence logits
    caps: list[int]  # [B] verify caps (request_caps)
    greedy: list[bool]  # [B] temperature 0


class VerifyOutcome(NamedTuple):
    """What verification did with the drafts it was given, one row per request."""

    req_ids: list[str]
    num_verified: list[int]  # [B] drafts verified
    accepted: list[int]  # [B] of those, accepted
    left: list[int | None] | None = None  # [B] tokens left before max_tokens ahead of this step (None: unknown)


class StepTiming(NamedTuple):
    """The runner's timing of a step's drafting path (the clock times the step)."""

    draft_seconds: float = 0.0  # the whole drafting path, the controller's choices included
    drafted: int = 0  # blocks drafted (0: the drafter was skipped)
    excluded_seconds: float = 0.0  # of draft_seconds, writing skipped steps' queued context
    walk_seconds: float = 0.0  # of draft_seconds, the Markov walk


NO_DRAFT = StepTiming()


def request_caps(extra_args: list[dict | None], left: list[int | None] | None, k: int) -> list[int]:
    """Per-request verify caps: SamplingParams.extra_args' dspark_max_verify
    (validated at admission, default K), and one less than the tokens ``left``
    before the request's max_tokens (None: no limit): a step yields at most
    verified + 1 tokens, and verifying past max_tokens is wasted work."""
    caps = [int(ea.get(MAX_VERIFY_KEY, k)) if ea else k for ea in extra_args]
    if left is not None:
        caps = [c if n is None else max(0, min(c, n - 1)) for c, n in zip(caps, left)]
    return caps
