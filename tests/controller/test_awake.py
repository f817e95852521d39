"""AwakeProbes (awake.py): what an awake step without drafts costs over a plain one."""

import pytest

from vllm_dspark.controller.awake import AwakeProbes
from vllm_dspark.controller.clock import StepSample
from vllm_dspark.controller.tuning import ControllerTuning

TUNING = ControllerTuning()
STEP = 4e-3


def _probe(probes: AwakeProbes, step: int, share: float, reqs: int = 4, tokens: int | None = None) -> bool:
    """Arm after a run of ``reqs`` decode steps of STEP, probe at ``tokens``; True if it probed."""
    probes.arm(step, (reqs, reqs, STEP))
    if not probes.probing(reqs, reqs if tokens is None else tokens):
        return False
    probes.observe(StepSample(reqs, reqs, False, STEP * (1 + share) + 2e-4, 2e-4, 0, plain=False))
    return True


def test_the_awake_share_is_the_upper_quartile_of_the_last_probes_and_the_prior_before():
    """Until ``awake_probe_window // 2`` probes are in, the share is unknown
    (None); then the upper quartile of the last window's (a share taken low
    floors a price high), per batch-size class: a probe at 4 requests says
    nothing at 1."""
    window = TUNING.awake_probe_window
    probes = AwakeProbes(TUNING)
    shares = [0.01 * i for i in range(window)]
    for i, share in enumerate(shares):
        expected = None if i < window // 2 else pytest.approx(sorted(shares[:i])[3 * i // 4])
        assert probes.share(4) == expected, i
        assert _probe(probes, i, share)  # at every check until the window is full
    assert probes.share(4) == pytest.approx(sorted(shares)[3 * window // 4])
    assert probes.share(7) == probes.share(4) and probes.share(1) is None
    assert not _probe(probes, window, 0.5)  # the window full: one in awake_probe_every steps
    assert _probe(probes, window + TUNING.awake_probe_every, -0.5)
    assert probes.share(4) >= 0.0  # a faster awake step says the share is nothing, not less


def test_a_probe_is_armed_only_after_a_run_of_decode_steps_and_runs_only_at_its_batch():
    """No run timed (None), a run with prompt work (tokens beyond requests):
    nothing armed, so the next step coasts. A probe armed for one batch does
    not run at another (the batch changed: the run's mean is not its
    reference), and is disarmed. A plain step recorded after a probe is not
    taken as its sample."""
    probes = AwakeProbes(TUNING)
    probes.arm(0, None)
    probes.arm(0, (4, 9, STEP))
    assert not probes.armed
    assert not _probe(probes, 0, 0.1, tokens=5)
    assert not probes.armed
    probes.arm(1, (4, 4, STEP))
    assert probes.probing(4, 4)
    probes.observe(StepSample(4, 4, False, 2 * STEP, 0.0, 0, plain=True))
    probes.observe(StepSample(4, 4, False, 2 * STEP, 0.0, 0, plain=False))  # too late: the probe's was the plain one
    assert probes._shares == {}
    off = AwakeProbes(ControllerTuning(awake_probe_window=0))
    off.arm(0, (4, 4, STEP))
    assert not off.armed and off.share(4) is None and off.state() == {}


def test_checks_hurry_only_while_the_share_is_unmeasured_and_a_window_of_them_at_most():
    """``hurries``: keep the dormant checks close (each arms a probe) at a
    batch size whose share is unknown, until it is measured or
    ``awake_probe_window`` checks there have hurried (where decode runs are
    too rare to probe, the checks must spread out again); per batch-size
    class; never with probes off."""
    window = TUNING.awake_probe_window
    probes = AwakeProbes(TUNING)
    assert [probes.hurries(4, i) for i in range(window + 2)] == [True] * window + [False, False]
    assert probes.hurries(1, 0) and probes.hurries(16, 0)  # another class on its own
    measured = AwakeProbes(TUNING)
    assert measured.hurries(2, 0)
    for i in range(window // 2):
        assert _probe(measured, i, 0.1, reqs=2)
    assert not measured.hurries(2, 0) and not measured.hurries(3, 0)
    assert not AwakeProbes(ControllerTuning(awake_probe_window=0)).hurries(4, 0)


def test_episodes_wait_for_the_share_for_awake_wait_steps_from_the_first_held_off():
    """``waits``: an episode that would open where the share is unmeasured is
    held off, and the checks hurry meanwhile beyond the window; one wait for
    the engine, ``awake_wait_steps`` steps from the first episode held off,
    whatever the batch size (a workload at many batch sizes must still
    explore); never where the share is measured, nor with the wait or the
    probes off."""
    wait = TUNING.awake_wait_steps
    probes = AwakeProbes(TUNING)
    assert probes.hurries(1, 0)  # checks before any episode is due: the window's
    assert probes.waits(1, 100)  # the first held off starts the wait
    assert all(probes.hurries(1, 100 + i) for i in range(2 * TUNING.awake_probe_window))  # beyond the window
    assert probes.waits(4, 100 + wait - 1) and not probes.waits(4, 100 + wait) and not probes.waits(1, 100 + wait)
    assert probes.hurries(4, 100 + wait)  # the window's again, per class
    measured = AwakeProbes(TUNING)
    for i in range(TUNING.awake_probe_window // 2):
        assert _probe(measured, i, 0.1, reqs=2)
    assert not measured.waits(2, 0) and measured.waits(1, 0)
    assert not AwakeProbes(ControllerTuning(awake_wait_steps=0)).waits(1, 0)
    assert not AwakeProbes(ControllerTuning(awake_probe_window=0)).waits(1, 0)
