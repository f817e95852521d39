"""The skip rule's estimate of what a drafted block yields (survival.py)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_dspark.config import DSparkKnobs
from vllm_dspark.controller.controller import DSparkController
from vllm_dspark.controller.plan import DraftBlocks, VerifyOutcome
from vllm_dspark.controller.survival import SurvivalWindow
from vllm_dspark.controller.tuning import SurvivalTuning


def test_estimate_uses_the_calibration_as_it_is_now():
    """Blocks drafted while the calibration said 0.5 are re-read with the
    calibration of now (an average of past calibrated values lagged it by
    thousands of steps at batch 1)."""
    w = SurvivalWindow(block_len=2, tuning=SurvivalTuning(refresh_every=1))
    w.add(torch.zeros(3, 2), [True] * 3)
    scale = [0.5]
    calibrate = lambda raw, greedy: torch.full_like(raw, scale[0])  # noqa: E731
    assert w.estimate(calibrate)[0] == pytest.approx([0.5, 0.25])
    scale[0] = 0.9
    w.changed()
    assert w.estimate(calibrate)[0] == pytest.approx([0.9, 0.81])


def test_ratio_is_accepted_over_expected_of_verified_blocks():
    w = SurvivalWindow(block_len=2, tuning=SurvivalTuning(min_expected=1.0))
    slots = w.add(torch.zeros(4, 2), [True] * 4)
    w.outcome(slots[:3], [2, 2, 1], [2, 1, 0])  # the fourth block was not verified
    calibrate = lambda raw, greedy: torch.full_like(raw, 0.5)  # noqa: E731
    mean, ratio = w.estimate(calibrate)
    # expected: 0.5 + 0.25 for the two blocks verified to 2, 0.5 for the third
    assert ratio == pytest.approx(3 / (2 * 0.75 + 0.5))
    assert mean == pytest.approx([0.5, 0.25])
    assert w.last == (mean, ratio)


def test_window_keeps_the_latest_blocks_and_refreshes_at_its_pace():
    w = SurvivalWindow(block_len=1, tuning=SurvivalTuning(window=4, refresh_every=3))
    slots = w.add(torch.zeros(6, 1), [True] * 6)
    assert slots[:2] == [None, None] and sorted(slots[2:]) == [0, 1, 2, 3]
    first = w.estimate(lambda raw, greedy: torch.sigmoid(raw))
    w.add(torch.full((1, 1), 10.0), [True])  # new block: stale, but refreshed only every 3 estimates
    calibrate = lambda raw, greedy: torch.sigmoid(raw)  # noqa: E731
    assert w.estimate(calibrate) == first and w.estimate(calibrate) == first
    assert w.estimate(calibrate)[0][0] > first[0][0]


def test_older_blocks_weigh_less():
    """Blocks drafted many steps ago (another request, another text) hardly
    count against the latest probe's; blocks of one step count alike."""
    tuning = SurvivalTuning(min_expected=1.0)
    w = SurvivalWindow(block_len=1, tuning=tuning)
    old = w.add(torch.full((4, 1), -2.0), [True] * 4, step=0)
    w.outcome(old, [1] * 4, [0] * 4)
    new = w.add(torch.full((2, 1), 2.0), [True] * 2, step=10 * tuning.half_life_steps)
    w.outcome(new, [1, 1], [1, 1])
    mean, ratio = w.estimate(lambda raw, greedy: torch.sigmoid(raw))
    fresh = float(torch.sigmoid(torch.tensor(2.0)))
    assert mean[0] == pytest.approx(fresh, abs=0.01)  # unweighted: (4 * 0.12 + 2 * 0.88) / 6 = 0.37
    assert ratio == pytest.approx(1 / fresh, abs=0.02)  # the new blocks were all accepted


def test_skip_rule_drafts_once_calibration_shows_drafting_pays():
    """Raw confidences say 0.5, every block is accepted in full: once the
    calibrator has learned that, the skip rule's survivals follow at once."""
    ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4)
    ctl.dormancy.wake()
    logits = torch.zeros(1, 4)
    for _ in range(200):
        ctl.choose(DraftBlocks(["a"], logits, [4], [True]))
        ctl.observe(VerifyOutcome(["a"], [4], [4]))
    learned = float(ctl.acceptance.calibrated(logits, [True])[0, 0])
    assert learned > 0.8  # the calibrator moved (raw sigmoid(0) is 0.5)
    ctl.plan(SimpleNamespace(req_ids=["a"], caps=lambda: [4]))
    mean, _ = ctl.acceptance.window.last
    assert mean[0] == pytest.approx(learned, abs=0.02)


def test_rows_wrap_around_the_ring():
    """A step whose rows run past the window's end writes the rest at its
    start, over the oldest blocks, and their slots say so."""
    w = SurvivalWindow(block_len=1, tuning=SurvivalTuning(window=4, refresh_every=1))
    assert w.add(torch.tensor([[0.1], [0.2], [0.3]]), [True] * 3) == [0, 1, 2]
    assert w.add(torch.tensor([[0.5], [0.6], [0.7]]), [True] * 3) == [3, 0, 1]
    mean, _ = w.estimate(lambda raw, greedy: raw.clone())  # survival = the raw value
    assert mean == pytest.approx([(0.5 + 0.6 + 0.7 + 0.3) / 4])


def _identity(raw, greedy):
    return raw.clone()


def test_positions_past_a_shallow_walk_come_from_blocks_walked_past_them():
    """Past a walk's depth a block has the parallel stage's tokens and their
    (lower) confidences. Position j's survival is the chain of conditional
    survivals over the blocks walked past j: shallow blocks (here: walked 1
    deep, 0.01 past it) leave positions 2-3 to the whole blocks (0.5 each);
    read from every block alike, as before, they halve position 2's. With
    one depth throughout, the chain is the mean of the products; with no
    block walked past a position, every block counts."""
    w = SurvivalWindow(block_len=3, tuning=SurvivalTuning(refresh_every=1))
    w.add(torch.tensor([[0.8, 0.5, 0.5]] * 2), [True] * 2, depth=3)
    w.add(torch.tensor([[0.8, 0.01, 0.01]] * 2), [True] * 2, depth=1)
    assert w.estimate(_identity)[0] == pytest.approx([0.8, 0.4, 0.2])
    same = SurvivalWindow(block_len=2, tuning=SurvivalTuning(refresh_every=1))
    same.add(torch.tensor([[0.9, 0.5], [0.5, 0.9]]), [True] * 2)
    assert same.estimate(_identity)[0] == pytest.approx([0.7, 0.45])
    shallow = SurvivalWindow(block_len=2, tuning=SurvivalTuning(refresh_every=1))
    shallow.add(torch.tensor([[0.8, 0.5], [0.6, 0.1]]), [True] * 2, depth=1)
    assert shallow.estimate(_identity)[0] == pytest.approx([0.7, (0.4 + 0.06) / 2])


def test_a_whole_walk_falls_due_a_quarter_half_life_after_the_last():
    tuning = SurvivalTuning()
    w = SurvivalWindow(block_len=4, tuning=tuning)
    due = int(tuning.half_life_steps / 4)
    assert w.deep_stale(0)  # none yet
    w.add(torch.zeros(1, 4), [True], step=10, depth=4)
    w.add(torch.zeros(1, 4), [True], step=12, depth=2)  # a shallow block does not count
    assert not w.deep_stale(10 + due) and w.deep_stale(11 + due)
