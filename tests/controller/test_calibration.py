"""Per-position calibration on synthetic outcomes with a known truth."""

import torch

from vllm_dspark.controller.calibration import PositionCalibrator
from vllm_dspark.controller.tuning import CalibrationTuning


def test_learns_platt_scaling_and_lowers_ece():
    """Truth: P(accept at k | earlier accepted) = sigmoid(2 z - 1). Seed 0,
    2000 steps x 16 requests; the raw head (sigmoid z) is miscalibrated."""
    gen = torch.Generator().manual_seed(0)
    cal = PositionCalibrator(3, CalibrationTuning(refit_every=20))
    for _ in range(2000):
        z = torch.randn(16, 3, generator=gen) * 1.5
        truth = torch.sigmoid(2 * z - 1)
        passed = torch.rand(16, 3, generator=gen) < truth
        accepted = passed.int().cumprod(1).sum(1)
        cal.observe(z, torch.full((16,), 3), accepted)
    assert abs(float(cal.alpha[0]) - 2) < 0.2 and abs(float(cal.beta[0]) + 1) < 0.2
    raw, calibrated = cal.ece("raw"), cal.ece("calibrated")
    assert all(c < r for c, r in zip(calibrated, raw)), (raw, calibrated)
    assert calibrated[0] < 0.03


def test_only_positions_through_the_first_rejection_are_observed():
    cal = PositionCalibrator(4, CalibrationTuning(refit_every=10**9))
    z = torch.zeros(2, 4)
    # request 0: verified 4, accepted 1 -> positions 0 (1) and 1 (0) observed
    # request 1: verified 2, accepted 2 -> positions 0, 1 observed, both accepted
    cal.observe(z, torch.tensor([4, 2]), torch.tensor([1, 2]))
    counts = cal.bins["raw"][..., 0].sum(1)
    outcomes = cal.bins["raw"][..., 2].sum(1)
    assert counts.tolist() == [2, 2, 0, 0]
    assert outcomes.tolist() == [2, 1, 0, 0]


def test_separable_outcomes_keep_parameters_bounded():
    """Every confident prediction accepted, every doubtful one rejected (as a
    well-trained head on easy text gives): the fit sharpens, but stays finite
    and bounded, and calibrated ECE does not blow up."""
    cal = PositionCalibrator(2, CalibrationTuning(refit_every=5))
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        z = torch.randn(32, 2, generator=gen) * 3
        accepted = (z[:, 0] > 0).long() * (1 + (z[:, 1] > 0).long())
        cal.observe(z, torch.full((32,), 2), accepted)
    assert torch.isfinite(cal.alpha).all() and torch.isfinite(cal.beta).all()
    bound = cal.tuning.param_bound
    assert (cal.alpha.abs() <= bound).all() and (cal.beta.abs() <= bound).all()
    assert (cal.alpha > 1).all()  # it did sharpen
    ece = cal.ece("calibrated")
    assert all(e is not None and e < 0.1 for e in ece), ece


def test_a_position_without_outcomes_of_its_own_takes_the_nearest_shallower_fit():
    """Verification stops at the first rejection, so the last positions may
    never gather enough outcomes for a fit. Truth at positions 0-1:
    sigmoid(z - 2) (the raw head, sigmoid(z), overconfident); every block
    verifies only 2 of 4. Positions 2 and 3 take position 1's fit, not the
    raw head; once position 2 has outcomes of its own, it keeps its own fit.
    Seed 0, 400 steps x 16 requests."""
    gen = torch.Generator().manual_seed(0)
    cal = PositionCalibrator(4, CalibrationTuning(refit_every=20))

    def run(steps, verified):
        for _ in range(steps):
            z = torch.randn(16, 4, generator=gen) + 2
            passed = torch.rand(16, 4, generator=gen) < torch.sigmoid(z - 2)
            accepted = passed.int().cumprod(1)[:, :verified].sum(1)
            cal.observe(z, torch.full((16,), verified), accepted)

    run(400, 2)
    assert abs(float(cal.beta[1]) + 2) < 0.4  # fitted: about sigmoid(z - 2)
    assert cal.alpha[2:].tolist() == [cal.alpha[1].item()] * 2 and cal.beta[2:].tolist() == [cal.beta[1].item()] * 2
    z = torch.full((1, 4), 2.0)
    assert float(cal.calibrate(z)[0, 3]) < 0.6 < float(torch.sigmoid(z)[0, 3])  # not the raw head's 0.88
    run(400, 3)
    assert float(cal.alpha[2]) != float(cal.alpha[1]) and cal.alpha[3].item() == cal.alpha[2].item()
