"""Scheduler-side load, stamped onto each SchedulerOutput for the worker.

The worker only sees the batch it is given; the queue behind it and the KV
pool live in the scheduler. DSparkScheduler copies what the controller needs
onto the step's SchedulerOutput (a plain dataclass the executor pickles to the
worker), so it arrives with the step it describes.
"""

from typing import NamedTuple

ATTR = "dspark_load"


class LoadSignals(NamedTuple):
    # A tuple: built on every step and pickled with it, half the cost of a
    # frozen dataclass, a third of its pickled size.
    running: int  # requests in the running queue (scheduled or not this step)
    waiting: int  # requests waiting for admission
    kv_usage: float  # fraction of KV blocks in use, 0..1
    scheduled_tokens: int  # tokens the target runs this step
    token_budget: int  # max_num_batched_tokens
    max_running: int = 0  # max_num_seqs: how many requests can decode at once (0: unknown)
    draft_slots: bool = True  # KV slots were reserved for a block's drafts (scheduler.py): the drafter may run

    @property
    def headroom(self) -> int:
        return max(0, self.token_budget - self.scheduled_tokens)


def prefill_tokens(scheduler_output) -> int:
    """Tokens of requests scheduled without drafts and more than one token:
    prompt chunks (a decode step runs 1 + its drafts)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    return sum(n for rid, n in scheduler_output.num_scheduled_tokens.items()
               if n > 1 and not spec.get(rid))


def load_of(scheduler_output) -> LoadSignals | None:
    return getattr(scheduler_output, ATTR, None)
