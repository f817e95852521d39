"""Rank-consistent decisions under tensor parallelism.

Every rank runs its own controller, and the drafter's forward holds
collectives: if two ranks ever disagreed on drafting, or on running a step
plain, they would wait on each other for good. Each controller decides from
the step's view (the same scheduler output on every rank), verification
outcomes (the same sampled tokens) and its own step timings, which differ. So
each step's timings are rank 0's: the controller hands its held step to
``share``, which broadcasts rank 0's over the tensor-parallel group, and
every rank then learns, prices and decides from the same numbers.
"""

import time
from collections.abc import Callable

import torch

from vllm_dspark import envs


def rank0_share(tp_world_size: int) -> Callable[[list[float]], list[float]] | None:
    """Rank 0's values for these, on every rank (None: one rank, nothing to share)."""
    if tp_world_size <= 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()

    def share(values: list[float]) -> list[float]:
        buf = torch.tensor(values, dtype=torch.float64)
        group.broadcast(buf, src=0)
        return buf.tolist()

    return share


def step_clock(rank: int) -> Callable[[], float]:
    """The controller's clock. VLLM_DSPARK_TEST_CLOCK_SKEW_S (tests only)
    makes every reading on ranks other than 0 that many seconds later than
    the one before it, so their timings disagree with rank 0's."""
    skew = envs.VLLM_DSPARK_TEST_CLOCK_SKEW_S
    if rank == 0 or not skew:
        return time.perf_counter
    calls = [0]

    def now() -> float:
        calls[0] += 1
        return time.perf_counter() + skew * calls[0]

    return now
