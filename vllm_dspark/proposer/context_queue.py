"""Context of steps that skipped drafting, staged for one batched write.

A step without drafting still owes the drafter its tokens' context K/V (fused
target features of every token), or drafting resumes over a hole. Written step
by step that is a drafter-sized pass of small ops per step; staged here, it
goes in one write before the next drafting step, or when the queue is full.

Two measured choices (tiny pair, CPU, 64 requests):
  * Staging copies into one buffer that is reused. Holding on to each step's
    tensors instead made the target's own forward 4-8% slower (the allocator
    could not reuse that memory); with the copies, a skipping engine's
    forward is as fast as one without speculation.
  * Tokens of requests that finished meanwhile are not written (their KV
    blocks are free). Under sustained load the engine drafts seldom, and most
    queued tokens belong to requests that never see a draft.
"""

import torch

# At most this many steps, or this many bytes of target features, wait (at 64
# requests of 64 tokens on the tiny pair, 256 steps are about three request
# lifetimes, 24 MiB). A step bigger than the whole buffer is written at once.
CONTEXT_QUEUE_STEPS = 256
CONTEXT_QUEUE_BYTES = 64 << 20


class ContextQueue:
    """``write(features, positions, slots)`` puts tokens into the drafter's
    context KV cache; the queue calls it when full, and ``flush`` on demand."""

    def __init__(self, write):
        # Request ids whose context is still wanted (the runner sets a view of
        # its requests: live ones with context); None keeps every queued token.
        self.live_requests = None
        self._write = write
        self._features: torch.Tensor | None = None  # [capacity, sum of aux widths]
        self._places: torch.Tensor | None = None  # [capacity, 2]: position, slot
        self._used = 0
        self._steps: list[tuple[list[str] | None, list[int] | None, int]] = []

    def __len__(self) -> int:
        """Steps queued."""
        return len(self._steps)

    def add(self, aux_hidden_states: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor,
            req_ids: list[str] | None = None, tokens_per_req: list[int] | None = None) -> None:
        """Queue a step's first ``positions.shape[0]`` tokens; ``req_ids`` with
        ``tokens_per_req`` (batch order) let the write leave out requests that
        finished meanwhile."""
        n = positions.shape[0]
        # On CPU the tensors are exactly n rows: no slicing op (each small op
        # costs ~10 us inside a busy engine there).
        parts = [h if h.shape[0] == n else h[:n] for h in aux_hidden_states]
        first = parts[0]
        width = sum(h.shape[-1] for h in parts)
        if n * width * first.element_size() > CONTEXT_QUEUE_BYTES:
            # Bigger than the whole buffer: what is queued, then this step, at once.
            self.flush()
            self._write(torch.cat(parts, dim=-1), positions[:n], slots[:n])
            return
        buf = self._features
        same_kind = (buf is not None and buf.shape[1] == width and buf.dtype == first.dtype
                     and buf.device == first.device)
        if not same_kind or self._used + n > buf.shape[0]:
            self.flush()  # after it, a buffer of the same kind has room: n fits the byte bound
        if not same_kind:
            capacity = CONTEXT_QUEUE_BYTES // (width * first.element_size())
            self._features = buf = torch.empty(capacity, width, dtype=first.dtype, device=first.device)
            self._places = torch.empty(capacity, 2, dtype=torch.int64, device=positions.device)
        # Two ops a step: features, then positions and slots side by side.
        end = self._used + n
        torch.cat(parts, dim=-1, out=buf[self._used:end])  # rows are contiguous
        torch.stack([positions[:n], slots[:n]], dim=1, out=self._places[self._used:end])
        self._steps.append((req_ids, tokens_per_req, n))
        self._used = end
        if len(self._steps) >= CONTEXT_QUEUE_STEPS or self._used >= buf.shape[0]:
            self.flush()

    def flush(self) -> None:
        """Write everything queued (nothing when empty)."""
        batch = self._take()
        if batch is not None:
            self._write(*batch)

    def _take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Empty the queue: (features, positions, slots) to write, oldest
        first, without finished requests' tokens, and each slot once, with
        its latest features (a freed slot can be queued again by its next
        owner; that is what writing step by step would have left). None when
        nothing is left to write. The tensors may be views of the buffer:
        they are written before the next ``add``."""
        if not self._steps:
            return None
        used, steps, live = self._used, self._steps, self.live_requests
        self._used, self._steps = 0, []
        features, positions, slots = self._features[:used], self._places[:used, 0], self._places[:used, 1]
        if live is not None:
            keep, counts = [], []
            for req_ids, per_req, n in steps:
                if req_ids is None:
                    keep.append(True)
                    counts.append(n)
                else:
                    keep.extend(rid in live for rid in req_ids)
                    counts.extend(per_req)
            if not any(keep):
                return None
            if not all(keep):
                mask = torch.repeat_interleave(torch.tensor(keep), torch.tensor(counts)).to(slots.device)
                features, positions, slots = features[mask], positions[mask], slots[mask]
        unique, inverse = torch.unique(slots, return_inverse=True)
        if unique.numel() < slots.numel():
            order = torch.arange(slots.numel(), device=slots.device)
            last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, order, reduce="amax")
            features, positions, slots = features[last], positions[last], slots[last]
        return features, positions.contiguous(), slots.contiguous()  # columns of one buffer
