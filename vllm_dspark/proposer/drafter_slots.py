"""DrafterSlots: which KV slots hold drafter context for the token in them.

The drafter's layers share the target's block table, so a block the prefix
cache hands to a new request carries whatever drafter K/V its last writer
left. The target writes every scheduled token's slot; the drafter writes a
slot's context only on a drafting step, or when a skipped step's queued
context is flushed. A step run without speculation (dormant), or context
dropped from the queue, leaves the target's K/V in a slot with no drafter
context behind it, and a request that later hits that block would draft
from context that is not its own (still lossless: verification decides, but
acceptance suffers).

Each slot keeps the step of its last target write and of its last drafter
write; it holds context when the latter is not older. A new request whose
cached prefix has a slot without context keeps no drafter context (the
context ledger).
"""

import numpy as np
import torch


def _as_numpy(slots) -> np.ndarray:
    if isinstance(slots, np.ndarray):
        return slots
    return slots.detach().to("cpu", torch.int64).numpy()


class DrafterSlots:
    """Per slot, the steps of the last target and drafter writes; the last
    entry is a sink for padding (-1) slots, so a write is one indexed store.
    The runner records every step's slots while prefix caching is on, in
    NumPy: an indexed store there is a few µs cheaper than torch's, on every
    step of a dormant engine too."""

    def __init__(self):
        self.step = 0
        self._target = np.zeros(1, dtype=np.int64)  # per slot: step of the last target write
        self._drafter = np.full(1, -1, dtype=np.int64)  # and of the last drafter context write

    def _store(self, table: str, slots) -> None:
        slots = _as_numpy(slots)
        try:
            getattr(self, table)[slots] = self.step
        except IndexError:  # a slot past what was seen so far: grow (doubling), then store
            need = int(slots.max()) + 2
            grow = max(need, 2 * self._target.size) - self._target.size
            self._target = np.concatenate([self._target[:-1], np.zeros(grow + 1, dtype=np.int64)])
            self._drafter = np.concatenate([self._drafter[:-1], np.full(grow + 1, -1, dtype=np.int64)])
            getattr(self, table)[slots] = self.step

    def target_wrote(self, slots) -> None:
        """A step's target forward wrote these slots (a tensor or an int64
        array; a new step begins). On every step with prefix caching, so the
        usual case (an array of slots seen before) is one store: right after
        a forward each further call costs a few µs."""
        self.step += 1
        try:
            self._target[slots] = self.step
        except (IndexError, TypeError):  # a slot past those seen, or a device tensor
            self._store("_target", slots)

    def drafter_wrote(self, slots) -> None:
        """The drafter wrote its context into these slots."""
        self._store("_drafter", slots)

    def hold_context(self, block_ids: list[int], block_size: int, tokens: int) -> bool:
        """Do the first ``tokens`` slots of the blocks ``block_ids`` (a
        request's cached prefix) all hold drafter context?"""
        if tokens <= 0:
            return True
        ids = np.asarray(block_ids[: -(-tokens // block_size)], dtype=np.int64)
        slots = (ids[:, None] * block_size + np.arange(block_size)[None, :]).ravel()[:tokens]
        if int(slots.max()) >= self._target.size - 1:
            return False  # never written through this tracker
        return bool((self._drafter[slots] >= self._target[slots]).all())
