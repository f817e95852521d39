"""What drafted tokens are likely to be accepted: the confidence head's
calibration and the skip rule's window of recent blocks.

Acceptance means different things at temperature 0 (argmax match) and above
(min(1, p/q)), so greedy and sampled requests are calibrated apart. The
simulator injects an ``AcceptanceModel`` with hindsight calibrators (its
calibrated-information bound) through the controller's constructor.
"""

from typing import NamedTuple

import torch

from vllm_dspark.controller.calibration import PositionCalibrator
from vllm_dspark.controller.plan import DraftBlocks, VerifyOutcome
from vllm_dspark.controller.survival import SurvivalWindow
from vllm_dspark.controller.tuning import ControllerTuning


class PendingBlocks(NamedTuple):
    """The last choice, until verification reports on it."""

    rows: dict[str, int]  # request id -> row
    raw: list[list[float]]  # [B][K] raw confidence logits
    greedy: list[bool]  # [B]
    calibrated: torch.Tensor | None  # [B, K] as used, when tracing
    slots: list[int | None]  # each row's slot in the survival window (None: not kept)


class AcceptanceModel:
    def __init__(self, block_len: int, tuning: ControllerTuning, calibrate: bool = True,
                 calibrators: dict | None = None):
        if calibrators is None and calibrate:
            calibrators = {mode: PositionCalibrator(block_len, tuning.calibration) for mode in ("greedy", "sampled")}
        self.calibrators = calibrators  # None: raw sigmoid confidences
        # Recent blocks for the skip rule: mean calibrated survival per position
        # (the mean of the products, not the product of the means: confidences
        # along a block are correlated, and the latter undercounts the gain).
        self.window = SurvivalWindow(block_len, tuning.survival)
        self._pending: PendingBlocks | None = None
        # Decayed sums over verified steps, as the window's half-life: the plain
        # steps accepted drafts saved the batch (budget.steps_saved), and the
        # mean accepted per request; their ratio is what an accepted draft is worth.
        self._decay = 0.5 ** (1.0 / tuning.survival.half_life_steps)
        self._saved = self._mean = 0.0

    def calibrated(self, conf_logits: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
        """Conditional acceptance probabilities [B, K] from raw logits."""
        cal = self.calibrators
        if cal is None:
            return torch.sigmoid(conf_logits.float())
        if all(greedy) or not any(greedy):
            return cal["greedy" if greedy[0] else "sampled"].calibrate(conf_logits)
        mask = torch.tensor(greedy, device=conf_logits.device)[:, None]
        return torch.where(mask, cal["greedy"].calibrate(conf_logits), cal["sampled"].calibrate(conf_logits))

    def remember(self, blocks: DraftBlocks, caps: list[int], step: int, calibrated: torch.Tensor | None,
                 depth: int | None = None) -> None:
        """Keep this step's blocks (walked ``depth`` deep) until their outcome
        arrives. A block that may verify nothing never gets one, and one drafted
        without context says nothing of the others: neither joins the window."""
        raw = blocks.conf_logits.detach().float().cpu()
        greedy = blocks.greedy
        kept = [i for i, c in enumerate(caps) if c > 0]
        slots: list[int | None] = [None] * len(caps)
        if kept:
            picked = self.window.add(raw if len(kept) == len(caps) else raw[kept], [greedy[i] for i in kept], step,
                                     depth)
            for i, slot in zip(kept, picked):
                slots[i] = slot
        # Rows of floats: the calibration queues them.
        self._pending = PendingBlocks({rid: i for i, rid in enumerate(blocks.req_ids)}, raw.tolist(), greedy,
                                      calibrated, slots)

    def observe(self, outcome: VerifyOutcome, saved: float | None = None) -> PendingBlocks | None:
        """Verification's outcome for the remembered blocks (``saved``: the
        plain steps its accepted drafts saved the batch); returns them (for
        the trace), or None if none were waiting."""
        if saved is not None and outcome.accepted:
            self._saved = self._decay * self._saved + saved
            self._mean = self._decay * self._mean + sum(outcome.accepted) / len(outcome.accepted)
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        rows_of, raw, greedy, _, slots = pending
        # Outcomes per window slot, and per calibration mode for the blocks
        # verified at all. Only positions before a verify length get an
        # outcome, and the calibrator reads no further.
        window: tuple[list, list, list] = ([], [], [])
        picks = {"greedy": ([], [], []), "sampled": ([], [], [])}
        for rid, n, a in zip(outcome.req_ids, outcome.num_verified, outcome.accepted):
            i = rows_of.get(rid)
            if i is None:
                continue
            if slots[i] is not None:
                _append(window, slots[i], n, a)
            if n:
                _append(picks["greedy" if greedy[i] else "sampled"], i, n, a)
        self.window.outcome(*window)
        if self.calibrators is not None:
            self.window.changed()
            for mode, (rows, ver, acc) in picks.items():
                if rows:
                    self.calibrators[mode].observe([raw[i] for i in rows], ver, acc)
        return pending

    def estimate(self) -> tuple[list[float], float] | None:
        """(mean calibrated survival per position, accepted / expected ratio)
        over recent blocks; None before any."""
        return self.window.estimate(self.calibrated)

    def worth(self) -> float:
        """What an accepted draft is worth, as a share of a decoded token: in
        a closed batch (waves: no request takes a finished one's place) only
        the drafts of the request with the most left shorten it, and where
        acceptance differs by request the gate's mean survival overstated the
        gain (at c=4, bf16: drafting judged 10% ahead of plain steps while
        it ran 11% behind). An open batch's requests end apart: 1 there
        (``steps_saved`` falls back to the mean)."""
        return 1.0 if self._mean < 1.0 else min(1.0, self._saved / self._mean)

    def ratio(self) -> float:
        """The last estimate's accepted / expected ratio (1 before any; read
        from other threads, so never recomputed here)."""
        estimate = self.window.last
        return 1.0 if estimate is None else estimate[1]

    def state(self) -> dict | None:
        return {m: c.state() for m, c in self.calibrators.items()} if self.calibrators else None


def _append(columns: tuple[list, list, list], key: int, verified: int, accepted: int) -> None:
    """One block's (row or slot, tokens verified, tokens accepted)."""
    columns[0].append(key)
    columns[1].append(verified)
    columns[2].append(accepted)
