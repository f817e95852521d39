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

import torch


class DrafterSlots:
    """Per slot, the steps of the last target and drafter writes; the last
    entry is a sink for padding (-1) slots, so a write is one indexed store
    (the runner records every step's slots while prefix caching is on)."""

    def __init__(self):
        self.step = 0
        self._target = torch.zeros(1, dtype=torch.int64)  # per slot: step of the last target write
        self._drafter = torch.full((1,), -1, dtype=torch.int64)  # and of the last drafter context write

    def _store(self, table: str, slots: torch.Tensor) -> None:
        slots = slots.detach().to("cpu", torch.int64)
        try:
            getattr(self, table)[slots] = self.step
        except IndexError:  # a slot past what was seen so far: grow (doubling), then store
            need = int(slots.max()) + 2
            grow = max(need, 2 * self._target.numel()) - self._target.numel()
            self._target = torch.cat([self._target[:-1], torch.zeros(grow + 1, dtype=torch.int64)])
            self._drafter = torch.cat([self._drafter[:-1], torch.full((grow + 1,), -1, dtype=torch.int64)])
            getattr(self, table)[slots] = self.step

    def target_wrote(self, slots: torch.Tensor) -> None:
        """A step's target forward wrote these slots (a new step begins)."""
        self.step += 1
        self._store("_target", slots)

    def drafter_wrote(self, slots: torch.Tensor) -> None:
        """The drafter wrote its context into these slots."""
        self._store("_drafter", slots)

    def hold_context(self, block_ids: list[int], block_size: int, tokens: int) -> bool:
        """Do the first ``tokens`` slots of the blocks ``block_ids`` (a
        request's cached prefix) all hold drafter context?"""
        if tokens <= 0:
            return True
        ids = torch.tensor(block_ids[: -(-tokens // block_size)], dtype=torch.int64)
        slots = (ids[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:tokens]
        if int(slots.max()) >= self._target.numel() - 1:
            return False  # never written through this tracker
        return bool((self._drafter[slots] >= self._target[slots]).all())
