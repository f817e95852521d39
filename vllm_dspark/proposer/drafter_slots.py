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
    def __init__(self):
        self.step = 0
        self._target = torch.zeros(0, dtype=torch.int64)  # per slot: step of the last target write
        self._drafter = torch.zeros(0, dtype=torch.int64)  # and of the last drafter context write

    def _fit(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.detach().to("cpu", torch.int64)
        slots = slots[slots >= 0]  # padding
        need = int(slots.max()) + 1 if slots.numel() else 0
        if need > self._target.numel():
            size = max(need, 2 * self._target.numel())
            grow = size - self._target.numel()
            self._target = torch.cat([self._target, torch.zeros(grow, dtype=torch.int64)])
            self._drafter = torch.cat([self._drafter, torch.full((grow,), -1, dtype=torch.int64)])
        return slots

    def target_wrote(self, slots: torch.Tensor) -> None:
        """A step's target forward wrote these slots (a new step begins)."""
        self.step += 1
        slots = self._fit(slots)
        self._target[slots] = self.step

    def drafter_wrote(self, slots: torch.Tensor) -> None:
        """The drafter wrote its context into these slots."""
        slots = self._fit(slots)
        self._drafter[slots] = self.step

    def hold_context(self, block_ids: list[int], block_size: int, tokens: int) -> bool:
        """Do the first ``tokens`` slots of the blocks ``block_ids`` (a
        request's cached prefix) all hold drafter context?"""
        if tokens <= 0:
            return True
        ids = torch.tensor(block_ids[: -(-tokens // block_size)], dtype=torch.int64)
        slots = (ids[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:tokens]
        if int(slots.max()) >= self._target.numel():
            return False  # never written through this tracker
        return bool((self._drafter[slots] >= self._target[slots]).all())
