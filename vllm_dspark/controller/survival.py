"""What the skip rule expects a drafted block to yield, from recent blocks.

The last ``SurvivalTuning.window`` drafted blocks' raw confidences are kept
with their outcomes (tokens verified, tokens accepted). The estimate is their mean survival per
position, calibrated with the calibration as it is now, and the ratio of the
tokens those blocks had accepted to what that survival expected of them (what
calibration still gets wrong on average).

Blocks weigh less as they age, in engine steps (half-life
``SurvivalTuning.half_life_steps``): what a block yields depends on the request
and the text, and while drafting is skipped blocks come only from probes, one
per request, so the last few probes must decide (docs/tuning.md has the runs).

A block walked to a depth d < K has past d the parallel stage's tokens and
their confidences, lower than the walk's own would have been: position j's
survival comes from the blocks walked past j, as the chain of conditional
survivals (with one set of blocks it is the mean of their products). Read
from every block alike, a shallow walk made the positions past it look
worthless, and the depth that rule chose was never walked deeper again.
The controller therefore walks a whole block whenever the newest one is
older than a quarter of the half-life (``deep_stale``).
"""

import torch

from vllm_dspark.controller.tuning import SurvivalTuning


class SurvivalWindow:
    def __init__(self, block_len: int, tuning: SurvivalTuning = SurvivalTuning()):
        self.k = block_len
        self.tuning = tuning
        self.size = window = tuning.window
        # Rows of confidences as one tensor (a step writes its rows with one or
        # two slice copies); the rest per slot in plain lists: a step sets a
        # few entries, which as tensor writes cost more than the estimate.
        self._raw = torch.zeros(window, block_len)
        self._greedy = [False] * window
        self._verified = [0] * window
        self._accepted = [0] * window
        self._step = [0.0] * window  # engine step each block was drafted at
        self._depth = [block_len] * window  # positions its walk refined
        self._deep_step = None  # engine step of the newest block walked whole
        self._count = 0
        self._next = 0
        self._cached: tuple[list[float], float] | None = None
        self._stale = False
        self._age = 0

    def add(self, raw: torch.Tensor, greedy: list[bool], step: int = 0, depth: int | None = None) -> list[int | None]:
        """Keep engine step ``step``'s blocks (raw confidence logits [B, K]
        on CPU), walked ``depth`` deep (default K); returns each row's slot
        for ``outcome`` (None for rows beyond the window)."""
        depth = self.k if depth is None else depth
        if depth >= self.k:
            self._deep_step = step
        size = self.size
        n = raw.shape[0]
        kept = min(n, size)
        start = self._next
        head = min(kept, size - start)  # rows before the ring wraps
        self._raw[start:start + head] = raw[n - kept:n - kept + head]
        if head < kept:
            self._raw[:kept - head] = raw[n - kept + head:]
        slots = [(start + i) % size for i in range(kept)]
        for slot, g in zip(slots, greedy[n - kept:]):
            self._greedy[slot] = g
            self._verified[slot] = self._accepted[slot] = 0
            self._step[slot] = float(step)
            self._depth[slot] = depth
        self._next = (self._next + kept) % size
        self._count = min(size, self._count + kept)
        self._stale = True
        return [None] * (n - kept) + slots

    def outcome(self, slots: list[int], verified: list[int], accepted: list[int]) -> None:
        """What verification did with the blocks in ``slots``."""
        for slot, v, a in zip(slots, verified, accepted):
            self._verified[slot] = v
            self._accepted[slot] = a
        if slots:
            self._stale = True

    def changed(self) -> None:
        """The calibration moved: the next estimate is due for a refresh."""
        self._stale = True

    def deep_stale(self, step: int) -> bool:
        """Is the newest block walked whole older than a quarter of the
        half-life (or is there none)? Then positions past a shallower walk
        are going unmeasured."""
        return self._deep_step is None or step - self._deep_step > self.tuning.half_life_steps / 4

    @property
    def last(self) -> tuple[list[float], float] | None:
        """The latest estimate, without refreshing it."""
        return self._cached

    def estimate(self, calibrate) -> tuple[list[float], float] | None:
        """(weighted mean survival per position, accepted / expected ratio
        in [0.5, 2]) with ``calibrate(raw [N, K], greedy list) -> [N, K]``;
        None before any block. Weights are relative to the newest block, so
        the estimate changes only with the blocks, outcomes and calibration."""
        if self._count == 0:
            return None
        t = self.tuning
        if self._cached is None or (self._stale and self._age >= t.refresh_every):
            n = self._count
            steps = torch.tensor(self._step[:n], dtype=torch.float64)
            weight = torch.pow(0.5, (steps.max() - steps) / t.half_life_steps).float()
            surv = torch.cumprod(calibrate(self._raw[:n], self._greedy[:n]).float(), dim=1)
            reached = torch.arange(self.k)[None, :] < torch.tensor(self._verified[:n])[:, None]
            expected = float((weight[:, None] * surv * reached).sum())
            accepted = float((weight * torch.tensor(self._accepted[:n], dtype=torch.float32)).sum())
            ratio = min(max(accepted / expected, 0.5), 2.0) if expected >= t.min_expected else 1.0
            self._cached = (self._chain(weight, surv).tolist(), ratio)
            self._stale, self._age = False, 0
        self._age += 1
        return self._cached

    def _chain(self, weight: torch.Tensor, surv: torch.Tensor) -> torch.Tensor:
        """Mean survival per position [K]: the product of the conditional
        survivals, each over the blocks walked past its position (all blocks
        where none was)."""
        n = surv.shape[0]
        walked = torch.arange(self.k)[None, :] < torch.tensor(self._depth[:n])[:, None]
        before = torch.cat([torch.ones(n, 1), surv[:, :-1]], dim=1)
        w = weight[:, None]
        num, den = (w * surv).sum(0), (w * before).sum(0)
        num_walked, den_walked = (w * surv * walked).sum(0), (w * before * walked).sum(0)
        use = den_walked > 0
        num, den = torch.where(use, num_walked, num), torch.where(use, den_walked, den)
        return torch.cumprod(torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(den)), dim=0)
