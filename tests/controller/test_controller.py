"""DSparkController without vLLM: policies, caps and per-request bookkeeping,
driven through the calls the runner makes (plan.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_dspark.config import DSparkKnobs
from vllm_dspark.controller.clock import StepSample
from vllm_dspark.controller.controller import DSparkController
from vllm_dspark.controller.cost_curve import CostCurve
from vllm_dspark.controller.cost_model import CostParams
from vllm_dspark.controller.plan import DraftBlocks, StepPlan, StepTiming, StepView, VerifyOutcome, request_caps
from vllm_dspark.controller.tuning import ControllerTuning

TUNING = ControllerTuning()
FIXED_GAP = ControllerTuning(dormant_recheck_max=TUNING.dormant_recheck_every,  # dormant checks at one gap
                             awake_probe_window=0)  # no probes of the awake path (awake.py) between them
NO_PROBES = ControllerTuning(awake_probe_window=0)


def _ctl(tuning=TUNING, now=None, cold=False, **knobs):
    """A controller; awake unless ``cold`` (a fresh engine starts dormant
    until its exploration budget can price speculation)."""
    extra = {} if now is None else {"now": now}
    ctl = DSparkController(DSparkKnobs(persist_cost_model=False, **knobs), block_len=4, tuning=tuning, **extra)
    if not cold:
        ctl.dormancy.wake()
    return ctl


def _choose(ctl, ids, logits, caps, greedy):
    return ctl.choose(DraftBlocks(ids, logits, caps, greedy))


def _verified(ctl, ids, num_verified, accepted):
    ctl.observe(VerifyOutcome(ids, num_verified, accepted))


class _Requests:
    """plan.RequestView for tests."""

    def __init__(self, req_ids, caps=None):
        self.req_ids, self._caps = req_ids, caps

    def caps(self):
        return self._caps if self._caps is not None else [4] * len(self.req_ids)


def _skips(ctl, req_ids=("a",), caps=None) -> bool:
    """The controller's plan for this step skips the drafter."""
    return ctl.plan(_Requests(list(req_ids), caps)).mode == "skip"


def _view(reqs=("a",), verifies=False, **kw):
    return StepView(tuple(reqs), kw.get("new", ()), (), kw.get("load"), kw.get("tokens", len(reqs)), 0, verifies)


def test_policies_and_caps():
    logits = torch.tensor([[4.0, 4.0, 4.0, 4.0], [-4.0, 4.0, 4.0, 4.0]])
    greedy = [True, True]
    assert _choose(_ctl(policy="full"), ["a", "b"], logits, [4, 2], greedy) == [4, 2]
    assert _choose(_ctl(policy="threshold", threshold=0.5), ["a", "b"], logits, [4, 4], greedy) == [4, 0]
    assert _choose(_ctl(policy="adaptive"), ["a", "b"], logits, [0, 4], greedy)[0] == 0  # dspark_max_verify=0


def test_request_caps_from_extra_args():
    assert request_caps([None, {}, {"dspark_max_verify": 2}, {"other": 1}], None, 4) == [4, 4, 2, 4]


def test_outcomes_follow_request_ids_across_reordering():
    """Rows reorder between steps (vLLM condenses its batch); outcomes must be
    matched to the confidences of the same request."""
    ctl = _ctl(policy="full")
    logits = torch.tensor([[5.0, 5.0, 5.0, 5.0], [-5.0, -5.0, -5.0, -5.0]])
    _choose(ctl, ["sure", "hopeless"], logits, [4, 4], [True, True])
    # next step, the batch lists them the other way round
    _verified(ctl, ["hopeless", "sure"], [4, 4], [0, 4])
    bins = ctl.acceptance.calibrators["greedy"].bins["raw"]
    # position 0: a confident accept (top bin, outcome 1) and a doubtful reject (bottom bin, outcome 0)
    assert bins[0, -1].tolist() == pytest.approx([1.0, float(torch.sigmoid(torch.tensor(5.0))), 1.0])
    assert bins[0, 0].tolist()[::2] == [1.0, 0.0]
    assert ctl.acceptance.observe(VerifyOutcome(["sure"], [4], [4])) is None  # nothing carried past its step


def test_adaptive_shrinks_under_token_cost():
    ctl = _ctl()
    logits = torch.full((16, 4), 1.0)  # ~0.73 per position
    cheap = sum(_choose(ctl, [str(i) for i in range(16)], logits, [4] * 16, [True] * 16))
    for _ in range(300):  # the machine turns out to pay 2 ms per token
        ctl.costs.verify.observe(16, 64, 5e-3 + 2e-3 * 64)
        ctl.costs.verify.observe(16, 16, 5e-3 + 2e-3 * 16)
    dear = sum(_choose(ctl, [str(i) for i in range(16)], logits, [4] * 16, [True] * 16))
    assert dear < cheap


@pytest.mark.parametrize("rows,conf,base,tok,max_step,max_tokens", [
    (1, [0.9, 0.8, 0.5, 0.2], 5e-3, 1e-4, math.inf, 1 << 30),
    (64, [0.9, 0.8, 0.5, 0.2], 5e-3, 1e-4, math.inf, 1 << 30),
    (64, [0.9, 0.8, 0.5, 0.2], 5e-3, 1e-3, math.inf, 1 << 30),  # verification dear: fewer levels
    (16, [0.95] * 7, 5e-3, 1e-4, 5e-3 + 40e-4, 1 << 30),  # step cap cuts a level
    (16, [0.95] * 7, 5e-3, 1e-4, math.inf, 21),  # token cap cuts a level
    (8, [0.0, 0.9], 5e-3, 1e-4, math.inf, 1 << 30),  # nothing survives
])
def test_admitted_levels_match_the_op_on_identical_rows(rows, conf, base, tok, max_step, max_tokens):
    """The skip rule's closed form agrees with ops.adaptive_lengths when every
    request has the same confidences."""
    from vllm_dspark.controller.gate import admitted_levels
    from vllm_dspark.ops.reference import adaptive_lengths

    c = torch.tensor([conf] * rows, dtype=torch.float32)
    cap = torch.full((rows,), len(conf), dtype=torch.int32)
    lengths = adaptive_lengths(c, cap, base, tok, max_step, max_tokens)
    _assert_levels_are_the_op_s(admitted_levels(c[0].tolist(), rows, base, tok, max_step, max_tokens), c, lengths)


def _assert_levels_are_the_op_s(levels, conf, lengths):
    """Per position: as many admitted as the op's lengths reach, at the rows' survival."""
    surv = torch.cumprod(conf, 1)[0].tolist()
    reach = [int((lengths > j).sum()) for j in range(conf.shape[1])]
    assert [take for take, _ in levels] == [r for r in reach if r]
    for j, (_, s) in enumerate(levels):
        assert s == pytest.approx(surv[j], rel=1e-5)


def test_probe_pace_follows_what_a_probe_costs():
    """While skipping on priors alone, probes keep every probe_every-th step
    (they are what measures drafting). Once the drafting model is trusted, the
    gap is what keeps the probes' predicted loss near probe_loss_budget:
    long where drafting costs a lot, probe_every where it costs next to nothing."""
    t = TUNING

    def probe_gaps(ctl, steps):
        gaps, run = [], 0
        for _ in range(steps):
            if _skips(ctl):
                run += 1
            else:
                gaps.append(run)
                run = 0
        return gaps

    for draft_s, expect_long in ((0.01, True), (1e-5, False)):
        # No step can meet the SLO: never pays. Not dormant: probes at their exact pace.
        ctl = _ctl(slo_tokens_per_s=1e6, dormant_after_steps=0)
        _choose(ctl, ["a"], torch.zeros(1, 4), [4], [True])
        assert set(probe_gaps(ctl, 80)) == {t.probe_every - 1}
        # Only the drafting model: with no length worth verifying, probes
        # verify nothing and the verify-step model is never measured; that
        # must not keep probing at full pace forever.
        for _ in range(t.cost.min_observations):
            ctl.costs.draft.observe(1, 4, draft_s)
        est = ctl.costs.predict(1, 0, ctl.depth)
        plain, draft = est.plain, est.draft
        # A probe here verifies nothing: its goodput shortfall, weighted by how
        # much longer than a plain step it takes (what it costs in throughput).
        loss = (1 - plain / (plain + draft)) * (plain + draft) / plain
        expected = min(t.max_probe_every, max(t.probe_every, math.ceil(loss / t.probe_loss_budget)))
        gaps = probe_gaps(ctl, 3000)
        assert set(gaps[1:]) == {expected - 1}
        assert (expected > 10 * t.probe_every) == expect_long


def _recording(ctl):
    """The samples ``ctl`` records into its cost models, in a list."""
    seen = []
    observe = ctl.costs.observe
    ctl.costs.observe = lambda sample, *a, **kw: (seen.append(sample), observe(sample, *a, **kw))[1]
    return seen


def test_queued_context_write_is_no_model_s_cost():
    """A probe after skipped steps first writes their queued context; that time
    must reach neither the drafting model nor the step's own model (counted as
    drafting, it made probes look several times dearer than drafting is). The
    engine's work after a step is charged to that step."""
    clock = iter([0.0, 0.050, 0.051])  # a 50 ms step, then 1 ms of engine work before the next
    ctl = _ctl(now=lambda: next(clock))
    seen = _recording(ctl)
    ctl.begin_step(_view())
    ctl.end_step(StepTiming(0.040, 1, excluded_seconds=0.030))  # 40 ms drafting, 30 of it the queue
    assert not seen  # recorded once the gap after it is known
    ctl.begin_step(_view())
    (sample,) = seen
    assert (sample.reqs, sample.tokens, sample.drafted) == (1, 1, 1)
    assert sample.seconds == pytest.approx(0.021) and sample.draft_seconds == pytest.approx(0.010)


def test_engine_gap_is_charged_to_the_step_before_it():
    """The engine's work between steps grows with what the step before it
    produced: a verify step's gap must not be charged to the plain step after
    it, and an idle pause is charged as that kind's usual gap."""
    # start/end of four steps (verify, plain, plain after a 1 s pause, plain), then one more start
    clock = iter([0.000, 0.010, 0.014, 0.019, 1.019, 1.024, 1.025, 1.030, 1.031])
    ctl = _ctl(now=lambda: next(clock))
    seen = _recording(ctl)
    for verifies in (True, False, False, False):
        ctl.begin_step(_view(verifies=verifies))
        ctl.end_step(StepTiming())
    ctl.begin_step(_view(reqs=()))
    # verify: 10 ms + its 4 ms gap; plain: 5 ms + no plain gap seen yet (the
    # pause is idle); then 5 ms + 1 ms, twice
    assert [(s.verifies, round(s.seconds, 6)) for s in seen] == [
        (True, 0.014), (False, 0.005), (False, 0.006), (False, 0.006)]


def test_dormant_plain_steps_train_the_models_one_in_every_few():
    """While dormant, one plain step in dormant_record_every is recorded (the
    others count as steps, untimed); otherwise, and on any step that verifies,
    every step is."""
    every = TUNING.dormant_record_every

    def run(ctl, steps, verifies=False):
        seen = _recording(ctl)
        for _ in range(steps):
            ctl.begin_step(_view(verifies=verifies))
            ctl.end_step(StepTiming())
        return [s.verifies for s in seen]

    n = 10 * every
    awake, dormant, verifying, cold = _ctl(), _ctl(), _ctl(), _ctl(cold=True)
    dormant.dormancy.dormant = verifying.dormancy.dormant = True
    _fund(dormant)
    assert len(run(awake, n)) == n - 1  # the last step is recorded at the next start
    assert len(run(dormant, n + 1)) == n // every and dormant.steps == n  # the last one counts at the next start
    # Until the budget can price steps (its nospec model is warming up, then learning), every plain step is.
    warm = TUNING.price_warmup_steps + TUNING.budget_warmup_steps
    assert cold.dormancy.dormant and warm <= len(run(cold, warm + n)) < warm + n - 1
    assert cold.budget.ready
    assert run(verifying, n, verifies=True) == [True] * (n - 1)
    assert every > 1


def test_dormant_plain_steps_coast_between_the_rule_s_checks():
    """Dormant, where the runner runs plain steps: a step like the one before
    (nothing admitted, nothing verified) coasts unless the rule is due (one
    step in dormant_recheck_every): it is not recorded and does not run the
    rule, and once booked it counts as a plain step and the budget has earned
    its share at the nospec model's price. An admission or a verify step does
    not coast. Which steps coast depends on no timing: controllers with
    different clocks (ranks) coast on the same steps."""
    every = TUNING.dormant_recheck_every

    def run(ctl, views):
        seen, rules, coasted = _recording(ctl), [], []
        skips = ctl._skips
        ctl._skips = lambda *a: rules.append(1) or skips(*a)
        for v in views:  # as the runner drives it
            coasted.append(bool(ctl.coasts(v.req_ids, bool(v.new_req_ids), v.verifies, v.finished_req_ids,
                                           v.tokens)))
            if not coasted[-1]:
                ctl.begin_step(v)
                ctl.end_step(StepTiming())
        shown = ctl.snapshot().plain_steps  # the steps coasted count before they are booked...
        ctl.begin_step(_view(("a", "b", "d"), new=("d",)))  # ...by an admission
        assert ctl.coasting.pending == 0
        return coasted, len(seen), len(rules), shown

    ticks = [iter(range(10**6)), iter(range(0, 10**7, 7))]
    ctls = [DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True,
                             now=lambda it=it: next(it) * 1e-3, tuning=FIXED_GAP) for it in ticks]
    n = 8 * every
    views = [_view(("a", "b"))] * n + [_view(("a", "b", "c"), new=("c",))] + [_view(("a", "b"))] * 3
    runs = []
    for ctl in ctls:
        _fund(ctl)
        ctl.dormancy.sleep()
        ctl.dormancy.wake = lambda: None  # held dormant: the rule still runs (the budget would re-test)
        before = ctl.budget.balance
        runs.append(run(ctl, views))
        earned = sum(runs[-1][0]) * TUNING.budget_share * 5e-3  # at the pinned price, 5 ms a step
        assert ctl.budget.balance >= min(before + earned, TUNING.budget_cap_steps * 5e-3) > before
        # Every step counted, the last (coasting) one too; the admission that booked them counts next.
        assert ctl.snapshot().plain_steps == len(views) + 1 and ctl.steps == len(views) and runs[-1][0][-1]
        assert runs[-1][3] == len(views)
    assert runs[0] == runs[1]
    coasted, recorded, rules, _ = runs[0]
    assert not coasted[0] and not coasted[n]  # the first step, and an admission
    assert sum(coasted[:n]) == n - n // every - 1 and rules == len(views) + 1 - sum(coasted)  # the rule: 1 in every
    assert recorded < rules  # the rule's steps, one in dormant_record_every of them
    awake = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True)
    _fund(awake)
    awake.dormancy.wake()
    assert not any(run(awake, [_view(("a",), verifies=True)] * 8)[0])


def test_dormant_checks_that_find_no_pay_space_out_until_the_batch_size_changes():
    """Dormant, each check at the batch size of the last that finds drafting
    would not pay doubles the gap to the next, up to dormant_recheck_max: the
    rule's step costs a few percent of a plain one at a few requests. At
    another batch size (a power of two) the gap is dormant_recheck_every
    again, counted from the last check (a batch swinging across a power of
    two is checked no more often than that); so after waking, and after a
    check where drafting pays. No timing decides: every rank checks on the
    same steps."""
    every, most = TUNING.dormant_recheck_every, TUNING.dormant_recheck_max
    assert most > 2 * every

    def rule_steps(ctl, views) -> list[int]:
        ran, skips = [], ctl._skips
        ctl._skips = lambda *a: ran.append(i) or skips(*a)
        for i, v in enumerate(views):
            if not ctl.coasts(v.req_ids, bool(v.new_req_ids), v.verifies, v.finished_req_ids, v.tokens):
                ctl.begin_step(v)
                ctl.end_step(StepTiming())
        ctl._skips = skips
        return ran

    ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True, tuning=NO_PROBES)
    _fund(ctl)
    ctl.dormancy.sleep()
    ctl.dormancy.wake = lambda: None  # held dormant
    two, five = _view(("a", "b")), _view(("a", "b", "c", "d", "e"))
    ran = rule_steps(ctl, [two] * (8 * most))
    gaps = [b - a for a, b in zip(ran, ran[1:])]
    # The first check finds a new batch size (none checked before): the gaps grow from the one after it.
    assert ran[0] < every and gaps[1:4] == [every, 2 * every, 4 * every] and max(gaps) == most == gaps[-1], gaps
    assert len(ran) < 8 * most // every // 4  # a quarter of the checks at the shortest gap, or fewer
    ran = rule_steps(ctl, [five] * (4 * every))  # another batch size: the shortest gap, then growing again
    assert ran[0] < every and ran[1] - ran[0] == every and ran[2] - ran[1] == 2 * every
    swings = rule_steps(ctl, [two, five] * (4 * most))  # across a power of two on every step
    gaps = [b - a for a, b in zip(swings, swings[1:])]
    assert every - 1 <= min(gaps) and max(gaps) <= every + 1  # about as often as at the shortest gap
    del ctl.dormancy.wake
    ctl.dormancy.wake()
    ctl.dormancy.sleep()  # asleep again: the shortest gap
    ran = rule_steps(ctl, [five] * (2 * every))
    assert ran[1] - ran[0] == every


def test_an_awake_batch_without_drafter_context_coasts_as_a_dormant_one():
    """A batch admitted dormant keeps no drafter context, so awake its steps
    run plain whatever the rule says: they coast between the rule's checks
    as dormant ones do (checked and recorded on every step, they cost about
    200 us more than vLLM's at 16 requests, Intel Xeon, bf16). A batch
    admitted awake keeps context and does not coast."""
    every = TUNING.dormant_recheck_every

    def coasting(admitted_dormant: bool) -> list[bool]:
        ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True)
        _fund(ctl)
        if admitted_dormant:
            ctl.dormancy.sleep()
        else:
            ctl.dormancy.wake()
        ctl.begin_step(_view(("a", "b"), new=("a", "b")))
        if not admitted_dormant:
            ctl.plan(_Requests(["a", "b"]))  # admitted with context
        ctl.end_step(StepTiming())
        ctl.dormancy.wake()
        coasted = []
        for _ in range(4 * every):
            v = _view(("a", "b"))
            coasted.append(bool(ctl.coasts(v.req_ids, False, False, (), v.tokens)))
            if not coasted[-1]:
                ctl.begin_step(v)
                ctl.end_step(StepTiming())
            assert not ctl.dormancy.dormant
        return coasted

    coasted = coasting(admitted_dormant=True)
    assert sum(coasted) == 4 * every - 4  # the rule: one step in every
    assert not any(coasting(admitted_dormant=False))


def test_a_coasting_run_books_as_asking_every_step_would():
    """``coasts`` answers a coasting step with a run: the steps until the rule
    is due. A runner that coasts the rest of the run unasked while the batch
    stays the same, and reports them at its next call, ends with the steps
    coasted, the rule's checks, the counts and the budget of one that asks
    every step; a changed batch (an admission) ends the run early."""
    every = TUNING.dormant_recheck_every
    views = ([_view(("a", "b"))] * (3 * every + 2) + [_view(("a", "b", "c"), new=("c",))]
             + [_view(("a", "b", "c"))] * (2 * every + 1))

    def drive(runs: bool):
        ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True,
                               now=iter(range(10**6)).__next__, tuning=FIXED_GAP)
        _fund(ctl)
        ctl.dormancy.sleep()
        ctl.dormancy.wake = lambda: None
        rules, skips = [], ctl._skips
        ctl._skips = lambda *a: rules.append(1) or skips(*a)
        coasted, left, fast, batch, longest = [], 0, 0, None, 0
        for v in views:
            if runs and left and batch == v.req_ids and not v.new_req_ids:
                left, fast = left - 1, fast + 1
                coasted.append(True)
                continue
            run = ctl.coasts(v.req_ids, bool(v.new_req_ids), v.verifies, v.finished_req_ids, v.tokens, fast)
            longest = max(longest, run)
            coasted.append(run > 0)
            left, fast, batch = max(run - 1, 0), 0, v.req_ids
            if not run:
                ctl.begin_step(v)
                ctl.end_step(StepTiming())
        shown = ctl.snapshot(fast).plain_steps
        return coasted, len(rules), shown, ctl.budget.balance, longest

    asking, running = drive(False), drive(True)
    assert running[:4] == asking[:4]
    assert running[4] == every - 1 and asking[4] == every - 1  # a run: the steps until the rule is due
    assert sum(asking[0]) > len(views) // 2 and running[2] == len(views)


def test_the_nospec_models_learn_what_coasting_steps_cost_not_only_the_rule_s_steps():
    """Dormant, the only plain steps timed one by one are those the rule runs
    on, dearer than the steps that coast between them (here 5 ms against 4):
    priced against those alone, speculation at break-even looked like a gain.
    The clock times each coasting run as one span and its mean step teaches
    the nospec models, unless the step after it admits a request (the span
    may then hold the engine's idle time: here a second)."""
    t = [0.0]
    ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True, now=lambda: t[0])
    ctl.dormancy.sleep()
    ctl.dormancy.wake = lambda: None  # held dormant
    steady, admitting = _view(("a", "b")), _view(("a", "b", "c"), new=("c",))

    def step(v, idle=0.0):
        if ctl.coasts(v.req_ids, bool(v.new_req_ids), v.verifies, v.finished_req_ids, v.tokens):
            t[0] += 4e-3
            return
        t[0] += idle
        ctl.begin_step(v)
        t[0] += 5e-3
        ctl.end_step(StepTiming())

    for _ in range(60 * TUNING.dormant_recheck_max):
        step(steady)
    decode = ctl.costs.decode.params.predict(2, 2)
    assert 4e-3 <= decode < 4.4e-3  # the rule's steps alone: 5 ms
    step(admitting, idle=1.0)
    assert ctl.costs.decode.params.predict(2, 2) == pytest.approx(decode, rel=0.01)
    assert ctl.costs.nospec.params.predict(2, 2) < 4.4e-3


def test_a_dormant_engine_probes_its_awake_step_against_the_run_before_it():
    """Dormant, the step after one of the rule's checks now and then runs
    awake without drafts (a probe, awake.py): it does not coast, and its time
    over the mean step of the coasting run before the check is a sample of
    what the awake path costs. Here coasting steps take 4 ms, the rule's 5 ms
    and a probe 4.4: the share is 10% once ``awake_probe_window // 2`` are in
    (unknown before). Probes come at every check until the window is full,
    then one in ``awake_probe_every`` steps. Which steps probe depends on no
    timing: controllers with different clocks (ranks) probe on the same."""
    every, window = TUNING.awake_probe_every, TUNING.awake_probe_window

    def run(scale):
        t = [0.0]
        ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True,
                               now=lambda: t[0])
        ctl.dormancy.sleep()
        ctl.dormancy.wake = lambda: None  # held dormant
        v, probed, shares = _view(("a", "b")), [], []
        for i in range(4 * every):
            if ctl.coasts(v.req_ids, bool(v.new_req_ids), v.verifies, v.finished_req_ids, v.tokens):
                t[0] += 4e-3 * scale
                continue
            if ctl.begin_step(v) is None:
                probed.append(i)
                t[0] += 4.4e-3 * scale
            else:
                t[0] += 5e-3 * scale
            ctl.end_step(StepTiming())
            shares.append(ctl.budget.awake.share(2))
        return probed, shares

    probed, shares = run(1.0)
    assert run(1.3)[0] == probed
    assert len(probed) > window and shares[0] is None
    assert shares[-1] == pytest.approx(0.1, abs=0.01)
    gaps = [b - a for a, b in zip(probed[window:], probed[window + 1:])]
    assert gaps and min(gaps) >= every, gaps  # the window full: one probe in awake_probe_every steps
    assert max(b - a for a, b in zip(probed[:window], probed[1:window])) <= TUNING.dormant_recheck_max + 2


def _first_episode(tuning: ControllerTuning, wave: int, later: int) -> tuple[int, float | None]:
    """A fresh engine's step at which its first episode opened, and the awake
    share at its batch then: plain steps take 4 ms, the rule's 5 ms and a
    probe 4.4 ms (a share of 10%), in waves of ``wave`` steps: the first,
    the warm-up (costs.warm_up), of two requests, the rest of ``later``."""
    t = [0.0]
    ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True,
                           now=lambda: t[0], tuning=tuning)
    for i in range(64 * tuning.dormant_recheck_every):
        w = i // wave
        reqs = tuple(f"{r}{w}" for r in "abcd"[:2 if w == 0 else later])
        v = _view(reqs, new=reqs if i % wave == 0 else ())
        if ctl.coasts(v.req_ids, bool(v.new_req_ids), v.verifies, v.finished_req_ids, v.tokens):
            t[0] += 4e-3
            continue
        plain = ctl.begin_step(v) is not None
        if not ctl.dormancy.dormant:
            return i, ctl.budget.awake.share(len(reqs))
        t[0] += 5e-3 if plain else 4.4e-3
        ctl.end_step(StepTiming())
    raise AssertionError("no episode opened")


def test_a_fresh_engine_s_first_episode_finds_the_awake_share_measured():
    """Without the awake share nothing floors an episode's price (awake.py),
    and a fresh engine's first trial at a batch size is the one a slow spell
    beginning with it, or a price that drifted low, books as drafting's
    loss. So while the share is unmeasured the dormant checks stay close,
    each arming a probe, and the warm-up measures it at its batch size; at
    another (one request after a warm-up at two), no episode opens there
    until its probes have: without the wait (``awake_wait_steps`` 0) the
    first trial opened at once, with no share. Where the runs are too short
    to probe (waves of 2 steps), speculation still starts, within
    ``awake_wait_steps`` of when it would have."""
    wait = TUNING.awake_wait_steps
    step, share = _first_episode(TUNING, 48, 2)
    assert share == pytest.approx(0.1, abs=0.02)
    step, share = _first_episode(TUNING, 48, 1)
    assert share == pytest.approx(0.1, abs=0.02)
    unwaited, none = _first_episode(ControllerTuning(awake_wait_steps=0), 48, 1)
    assert none is None and unwaited < step <= unwaited + wait
    short, none = _first_episode(TUNING, 2, 1)
    unwaited, _ = _first_episode(ControllerTuning(awake_wait_steps=0), 2, 1)
    assert none is None and unwaited < short <= unwaited + wait


def test_a_fresh_engine_s_warm_up_steps_coast():
    """A fresh engine starts dormant and warms up until its first requests
    have finished (costs.warm_up): those steps teach no price, so between the
    rule's checks they coast like any dormant plain steps (recorded one by
    one, the controller took 135 µs a step at 16 requests, coasting 17 µs:
    AMD EPYC Zen 4; at 16 requests a 2,048-token cold start is all warm-up). Once
    the first requests are gone, the plain steps are timed and priced (here
    4 ms, where the warm-up's ran 8 ms) and dormant ones coast again."""
    t = [0.0]
    ctl = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True, now=lambda: t[0])
    assert ctl.dormancy.dormant and not ctl.budget.ready  # cold

    def wave(reqs, n, seconds):
        coasted = []
        for i in range(n):
            v = _view(reqs, new=reqs if i == 0 else ())
            coasted.append(bool(ctl.coasts(v.req_ids, bool(v.new_req_ids), v.verifies, v.finished_req_ids,
                                           v.tokens)))
            if not coasted[-1]:
                ctl.begin_step(v)
            t[0] += seconds
            if not coasted[-1]:
                ctl.end_step(StepTiming())
        return coasted

    n = 16 * TUNING.dormant_recheck_every
    first = wave(("a", "b"), n, 8e-3)
    assert ctl.costs.warming and not ctl.budget.ready
    # All but the first step, the rule's and the probes after its checks (awake.py), which measure
    # the awake share during the warm-up: the checks stay close until they have.
    assert sum(first) >= n - n // TUNING.dormant_recheck_every - TUNING.awake_probe_window - 2
    assert ctl.budget.awake.share(2) is not None
    second = wave(("c", "d"), n, 4e-3)
    assert not ctl.costs.warming and ctl.budget.ready
    assert ctl.costs.decode.params.predict(2, 2) == pytest.approx(4e-3, rel=0.05)
    assert sum(second[n // 2:]) >= n // 2 - n // TUNING.dormant_recheck_every  # coasting again once priced


def test_plain_cost_at_an_unseen_batch_size_comes_from_the_verify_model():
    """Plain steps seen only at R=4 cannot tell t0 from t_req; at R=16 the
    plain cost is the verify-step model (which has seen R=16) minus the verify
    path's overhead measured on the plain steps, not the plain model's guess."""
    costs = _ctl().costs
    true_verify = lambda r, b: 2e-3 + 5e-4 * r + 1e-4 * b  # noqa: E731
    n = TUNING.cost.min_observations
    for i in range(6 * n):
        r, b = (4, 16)[i % 2], 1 + i % 5  # verified drafts per request vary
        costs.observe(StepSample(r, r * b, True, true_verify(r, r * b), 0.0, 0))
    for _ in range(3 * n):
        costs.observe(StepSample(4, 4, False, true_verify(4, 4) - 1e-3, 0.0, 0))  # 1 ms cheaper than verifying
    assert costs.verify.covers(16) and not costs.plain.covers(16) and costs.plain.covers(4)
    assert costs.predict(16, 0, 4).plain == pytest.approx(true_verify(16, 16) - 1e-3, rel=0.05)
    assert costs.predict(4, 0, 4).plain == pytest.approx(true_verify(4, 4) - 1e-3, rel=0.05)


def test_request_caps_stop_at_max_tokens():
    """A step yields at most verified + 1 tokens: a request with n tokens left
    before max_tokens verifies at most n - 1 (none when it ends this step)."""
    assert request_caps([None, {"dspark_max_verify": 2}, None, None, None], [100, 100, 3, 1, 0], 4) == [4, 2, 2, 0, 0]
    assert request_caps([None], [None], 4) == [4]


def test_level_counts():
    from vllm_dspark.controller.gate import level_counts

    assert level_counts([0, 2, 4, 4, 9], 4) == [4, 4, 3, 3]
    assert level_counts([], 3) == [0, 0, 0]


@pytest.mark.parametrize("caps,max_tokens", [
    ([0] * 4 + [2] * 6 + [7] * 6, 1 << 30),
    ([0] * 4 + [2] * 6 + [7] * 6, 17),  # the token cap cuts the second level
    ([1, 3, 5, 7], 1 << 30),
])
def test_admitted_levels_with_caps_match_the_op(caps, max_tokens):
    from vllm_dspark.controller.gate import admitted_levels, level_counts
    from vllm_dspark.ops.reference import adaptive_lengths

    conf = [0.95] * 7
    rows = len(caps)
    c = torch.tensor([conf] * rows)
    lengths = adaptive_lengths(c, torch.tensor(caps, dtype=torch.int32), 5e-3, 1e-4, math.inf, max_tokens)
    levels = admitted_levels(conf, rows, 5e-3, 1e-4, math.inf, max_tokens, level_counts(caps, 7))
    assert levels
    _assert_levels_are_the_op_s(levels, c, lengths)


def _fund(ctl, plain_steps=1, seconds=5e-3):
    """The budget can price steps (the nospec models pinned at ``seconds`` a
    step) and has earned ``plain_steps`` plain steps' share over its first
    reserve (one episode's: below the cap)."""
    for model in (ctl.costs.nospec, ctl.costs.decode):
        model.pin(CostParams(seconds, 0.0, 0.0), "test")
    for _ in range(plain_steps):
        ctl.budget.settle(StepSample(1, 1, False, seconds, 0.0, 0, plain=True))


def _skip_rule_ctl(tuning=TUNING, **knobs):
    """A controller whose window says every drafted token is accepted, on
    pinned costs where drafting one block pays at R=1 (a cost_curve knob's own
    where given)."""
    ctl = _ctl(tuning, **knobs)
    linear = CostParams(5e-3, 1e-4, 1e-4)
    if not knobs.get("cost_curve"):
        ctl.costs.pin(CostCurve("test", spec=linear, plain=linear, draft=CostParams(3e-3, 1e-4, 1e-5)), "test")
    logits = torch.full((1, 4), 6.0)
    for _ in range(50):
        _choose(ctl, ["a"], logits, [4], [True])
        _verified(ctl, ["a"], [4], [4])
    return ctl


def _start(ctl, waiting, running=1, prompt_tokens=0, new=(), draft_slots=True):
    """A step of one decoding request ("a"), and one prompt chunk if asked
    (``draft_slots``: the scheduler reserved KV slots for drafts)."""
    from vllm_dspark.controller.signals import ATTR, LoadSignals

    scheduled = {"a": 1, **({"p": prompt_tokens} if prompt_tokens else {}), **dict.fromkeys(new, 1)}
    load = LoadSignals(running=running, waiting=waiting, kv_usage=0.1, scheduled_tokens=sum(scheduled.values()),
                       token_budget=4096, max_running=64, draft_slots=draft_slots)
    ctl.begin_step(StepView.of(SimpleNamespace(
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
        finished_req_ids=set(), **{ATTR: load})))


def test_snapshot_carries_the_step_s_load_as_json():
    import json

    ctl = _skip_rule_ctl()
    assert ctl.snapshot().load is None
    _start(ctl, waiting=3, running=5)
    load = json.loads(json.dumps(ctl.snapshot().to_json()))["load"]
    assert load["running"] == 5 and load["waiting"] == 3 and load["max_running"] == 64


def test_snapshot_shows_the_pace_the_budget_prices_at():
    ctl = _skip_rule_ctl()
    snap = ctl.snapshot()
    assert (snap.pace_factor, snap.pace_trust, snap.price_drift) == (1.0, 0.0, 1.0)  # no canary, no episode
    ctl.pace.factor, ctl.pace._fit.trust = 0.8, 0.5
    ctl.budget.drift._factor, ctl.budget.drift._anchor = 1.25, ctl.costs.decode.observations
    snap = ctl.snapshot().to_json()
    assert (snap["pace_factor"], snap["pace_trust"], snap["price_drift"]) == (0.8, 0.5, 1.25)


def test_skip_rule_values_tokens_at_the_batch_about_to_run():
    """One running request: its drafts pay (about 4 tokens worth 5 ms each
    against 3.5 ms of drafting and verifying). With 63 prompts queued behind
    it the batch is about to hold 64, where a token is worth a 64th of a
    decode step (0.28 ms): the same drafts no longer pay."""
    ctl = _skip_rule_ctl()
    _start(ctl, waiting=0)
    assert not _skips(ctl)
    _start(ctl, waiting=63)
    assert _skips(ctl)


def test_a_step_without_kv_slots_for_drafts_never_drafts():
    """The scheduler reserves no KV slots for a block's drafts while told the
    engine sleeps (scheduler.py); on such a step the drafter would write past
    a request's slots, so it skips however much drafting pays, every policy.
    The next step with slots drafts."""
    for knobs in ({}, {"policy": "full"}):
        ctl = _skip_rule_ctl(**knobs)
        _start(ctl, waiting=0, draft_slots=False)
        assert _skips(ctl)
        _start(ctl, waiting=0)
        assert not _skips(ctl)


def test_skip_rule_skips_a_request_with_nothing_left_to_verify():
    ctl = _skip_rule_ctl()
    _start(ctl, waiting=0)
    assert not _skips(ctl, caps=[4])
    assert _skips(ctl, caps=[0])  # it reaches max_tokens this step


def test_skip_rule_values_tokens_at_the_admitted_batch():
    """Prompts being taken in: this step runs 1 request, 63 more are admitted
    (running, not yet decoding); their batch is what a token is valued at."""
    ctl = _skip_rule_ctl()
    _start(ctl, waiting=0, running=64)
    assert _skips(ctl)


def test_probes_wait_out_prompt_steps():
    """Skipping, a due probe is put off while a step takes in prompts, but by
    no more than another probe gap."""
    tuning = ControllerTuning(probe_loss_budget=1e9)  # probes as often as allowed: every probe_every
    every = tuning.probe_every
    ctl = _skip_rule_ctl(tuning)
    for _ in range(every - 1):
        _start(ctl, waiting=0, running=64)
        assert _skips(ctl)
    _start(ctl, waiting=0, running=64, prompt_tokens=47)
    assert _skips(ctl)  # due, but this step takes in a prompt
    _start(ctl, waiting=0, running=64)
    assert not _skips(ctl)  # the probe
    for _ in range(2 * every - 1):
        _start(ctl, waiting=0, running=64, prompt_tokens=47)
        assert _skips(ctl)
    _start(ctl, waiting=0, running=64, prompt_tokens=47)
    assert not _skips(ctl)  # prompts on every step: probed anyway


def test_dormant_after_a_long_skip_until_drafting_pays():
    """Once 90% of the last dormant_after_steps steps skipped drafting, and
    drafting still does not pay, the controller is dormant (requests admitted
    from then on keep no drafter context). While dormant, the full rule runs
    every dormant_recheck_every steps; dormant_exit_checks of them in a row
    where drafting would pay end it, even if the request there has no
    context (those steps skip)."""
    tuning = ControllerTuning(probe_loss_budget=1e-9, awake_wait_steps=0)  # probes as seldom as allowed; no wait
    recheck = tuning.dormant_recheck_every
    ctl = _skip_rule_ctl(tuning, dormant_after_steps=16)
    _fund(ctl)
    for _ in range(16):
        _start(ctl, waiting=0, running=64)
        assert _skips(ctl) and not ctl.dormancy.dormant
    # The step that turns dormant admits its new request ("b") by its own verdict.
    _start(ctl, waiting=0, running=64, new=("b",))
    assert _skips(ctl, ("a", "b")) and ctl.dormancy.dormant
    assert ctl.ledger.among(["a", "b"]) == {"b"}
    # A lone check where drafting pays (a wave boundary) does not end it.
    ctl.ledger.lose_all(["a"])
    for running in (1,) * recheck + (64,) * recheck:
        _start(ctl, waiting=0, running=running)
        assert _skips(ctl) and ctl.dormancy.dormant
    # Load gone: drafting pays, but the request left has no context (cap 0).
    # Two checks in a row end dormancy (the budget holds an episode's reserve).
    dormant = []
    for _ in range(tuning.dormant_recheck_max + recheck):  # the next check as far off as those before put it
        _start(ctl, waiting=0)
        assert _skips(ctl)
        dormant.append(ctl.dormancy.dormant)
    assert not dormant[-1] and dormant.index(False) >= recheck
    _start(ctl, waiting=0)
    assert not _skips(ctl, ("c",))  # the next request has context: it drafts
    never = _skip_rule_ctl(tuning, dormant_after_steps=0)
    # Dormancy at any batch size: one request where drafting never pays.
    small = _skip_rule_ctl(tuning, dormant_after_steps=16, slo_tokens_per_s=1e6)  # never pays
    for _ in range(100):
        _start(never, waiting=0, running=64)
        assert _skips(never) and not never.dormancy.dormant
        _start(small, waiting=0, running=1)
        assert _skips(small)
    assert small.dormancy.dormant and not _ctl(cold=True, dormant_after_steps=0).dormancy.dormant


def test_dormancy_ends_only_where_drafting_pays_beyond_the_cost_models_error():
    """Dormant at 64 requests; then 8 are coming and drafting is cheap (re-
    pinned: 0.3 ms a block), so drafting pays 2-5x what drafting and
    verifying cost. Checks count toward ending dormancy only where the net
    exceeds the models' recent mean relative error times that cost: not at
    500% error, yes at 100%; and only while the budget holds an episode's
    reserve."""
    tuning = ControllerTuning(probe_loss_budget=1e-9, awake_wait_steps=0)  # episodes open at once
    ends = []
    for running, error, funded in ((8, 5.0, True), (8, 1.0, True), (8, 1.0, False)):
        ctl = _skip_rule_ctl(tuning, dormant_after_steps=16)
        _fund(ctl)
        if not funded:
            ctl.budget.balance = -1.0  # in debt
        for _ in range(17):
            _start(ctl, waiting=0, running=64)
            _skips(ctl)
        assert ctl.dormancy.dormant
        linear = CostParams(5e-3, 1e-4, 1e-4)
        ctl.costs.pin(CostCurve("cheap drafts", spec=linear, plain=linear, draft=CostParams(3e-4, 1e-5, 1e-6)), "t")
        ctl.costs._errors.extend([error] * 10)
        ctl.ledger.lose_all(["a"])
        checks = []
        for _ in range(4 * tuning.dormant_recheck_every):
            _start(ctl, waiting=0, running=running)
            _skips(ctl)
            checks.append(ctl.dormancy.dormant)
        ends.append(checks.index(False) if False in checks else None)
    assert ends[0] is None and ends[1] is not None and ends[2] is None


def test_a_pinned_curve_ends_dormancy_however_far_off_this_machine_is(tmp_path):
    """With a cost curve pinned from a file, the choice must not depend on how
    fast this machine is: measured steps 500% off the curve do not keep a
    dormant engine plain where the curve says drafting pays (in CI, an engine
    slept during one statistical test and never drafted in the next)."""
    import json

    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"name": "t", "spec": {"t0": 5e-3, "t_req": 1e-4, "t_tok": 1e-4},
                                "draft": {"t0": 3e-4, "t_req": 1e-5, "t_tok": 1e-6}}))
    ctl = _skip_rule_ctl(dormant_after_steps=16, cost_curve=str(path))
    assert ctl.dormancy.budget is None
    ctl.dormancy.sleep()
    ctl.costs._errors.extend([5.0] * 10)
    ctl.ledger.lose_all(["a"])
    woke = False
    for _ in range(4 * TUNING.dormant_recheck_every):
        _start(ctl, waiting=0, running=8)
        _skips(ctl)
        woke = woke or not ctl.dormancy.dormant
    assert woke


def test_dormant_engine_never_drafts_and_re_tests_on_a_full_budget():
    """Dormant, nothing drafts, even a request with context; the verdict
    (drafting does not pay) is re-tested once the balance is full: an
    episode starts, and requests admitted then keep context."""
    # Awake, a probe would come every probe_every; episodes open at once.
    tuning = ControllerTuning(probe_loss_budget=1e9, awake_wait_steps=0)
    ctl = _skip_rule_ctl(tuning, dormant_after_steps=16, slo_tokens_per_s=1e6)  # never pays
    _fund(ctl)
    ctl.dormancy.sleep()
    for _ in range(100):
        _start(ctl, waiting=0, running=64)
        assert _skips(ctl)
    assert ctl.dormancy.dormant and not ctl.budget.full
    _fund(ctl, 100 * int(tuning.budget_cap_steps / tuning.budget_share))
    assert ctl.budget.full
    woke = []
    for _ in range(tuning.dormant_recheck_max):  # the next check, as far off as checks that found no pay put it
        _start(ctl, waiting=0, running=64, new=("b",))
        _skips(ctl, ("a", "b"))
        woke.append(not ctl.dormancy.dormant)
    assert woke[-1]


def test_no_probe_without_a_request_that_has_context():
    ctl = _ctl(slo_tokens_per_s=1e6, dormant_after_steps=0)  # never pays; untrusted models: a probe every probe_every
    _choose(ctl, ["a"], torch.zeros(1, 4), [4], [True])
    ctl.ledger.lose_all(["a"])
    assert all(_skips(ctl, ("a",)) for _ in range(100))
    assert not all(_skips(ctl, ("b",)) for _ in range(100))


def test_blocks_that_verify_nothing_stay_out_of_the_skip_rule_window():
    """A block capped at 0 (no context, or dspark_max_verify=0) never gets an
    outcome; its confidences must not move what the skip rule expects."""
    ctl, alone = _ctl(policy="full"), _ctl(policy="full")
    _choose(ctl, ["a", "x"], torch.tensor([[4.0] * 4, [-4.0] * 4]), [4, 0], [True, True])
    _choose(alone, ["a"], torch.tensor([[4.0] * 4]), [4], [True])
    surv, _ = ctl.acceptance.estimate()
    assert surv == pytest.approx(alone.acceptance.estimate()[0])
    assert surv[0] > 0.9


def _depth_ctl(walk_s: float):
    """An adaptive controller at R=1 whose window says positions 1-2 pass
    nearly always (0.98 each) and 3-4 half the time (half of each block is
    accepted: survivals scaled to about 0.73, 0.72, 0.36, 0.18), on known
    costs: a 5.2 ms step, 0.1 ms per verified token, 1 ms of drafting plus
    ``walk_s`` per walked position."""
    ctl = _ctl(calibration=False)
    linear = CostParams(5e-3, 1e-4, 1e-4)
    ctl.costs.verify.pin(linear, "test")
    ctl.costs.plain.pin(linear, "test")
    for _ in range(TUNING.cost.min_observations):
        ctl.costs.draft.observe(1, 4, 1e-3)
        ctl.costs.walk.observe(1, 0, walk_s)
    logits = torch.tensor([[4.0, 4.0, 0.0, 0.0]])
    for _ in range(50):
        _choose(ctl, ["a"], logits, [4], [True])
        _verified(ctl, ["a"], [4], [2])
    _start(ctl, waiting=0)
    return ctl, logits


@pytest.mark.parametrize(("walk_s", "depth"), [(1.5e-3, 3), (1e-6, 4)])
def test_walk_depth_is_where_another_position_stops_paying(walk_s, depth):
    """A position is walked when what it adds is worth its walk and its
    verification: at 1.5 ms a position, position 4 (0.18 tokens, worth
    0.9 ms) is not, position 3 (0.36, 1.9 ms) is; when walking costs
    nothing, 4 is too. Lengths then stop at the depth."""
    ctl, logits = _depth_ctl(walk_s)
    plan = ctl.plan(_Requests(["a"]))
    assert plan.mode == "draft" and plan.depth == depth
    before = list(ctl.telemetry.totals.depth_hist)
    lengths = _choose(ctl, ["a"], logits, [4], [True])
    assert 0 < lengths[0] <= depth
    assert ctl.telemetry.totals.depth_hist[depth] == before[depth] + 1


def test_a_shallow_depth_walks_a_whole_block_when_the_last_is_stale():
    """Positions past a shallow walk are measured only by whole walks
    (survival.py): once the newest whole block is older than a quarter of
    the window's half-life, the next drafting step walks all K positions,
    and the one after it the depth the gate chose again."""
    ctl, logits = _depth_ctl(1.5e-3)
    assert ctl.plan(_Requests(["a"])).depth == 3
    ctl.steps += int(TUNING.survival.half_life_steps)
    assert ctl.plan(_Requests(["a"])).depth == 4
    _choose(ctl, ["a"], logits, [4], [True])
    assert ctl.plan(_Requests(["a"])).depth == 3


def _asking(ctl):
    """A step driver that records whether the rule ("rule") and the lengths ("lengths") were asked."""
    asked = []
    assess, lengths = ctl.gate.assess, ctl.policy.lengths
    ctl.gate.assess = lambda *a, **k: asked.append("rule") or assess(*a, **k)
    ctl.policy.lengths = lambda *a, **k: asked.append("lengths") or lengths(*a, **k)

    def step(tokens, reqs=("a",), logit=6.0, last=None):
        """``last``: the logit of positions 3-4 (default ``logit``)."""
        asked.clear()
        ctl.begin_step(StepView(reqs, (), (), None, tokens, 0, tokens > len(reqs)))
        plan = ctl.plan(_Requests(list(reqs)))
        n = len(reqs)
        tail = logit if last is None else last
        logits = torch.tensor([[logit, logit, tail, tail]] * n)
        got = _choose(ctl, list(reqs), logits, [4] * n, [True] * n) if plan.mode == "draft" else None
        return plan, got, list(asked)

    return step


def test_a_verdict_that_verifies_every_draft_holds_for_its_batch_unasked():
    """The rule finds that drafting pays and its lengths verify every drafted
    token: the next cruise_every - 1 steps of the same batch (its requests,
    and the tokens those lengths scheduled) draft at its depth and verify
    every drafted token without the rule or the lengths being asked
    (gate.py), whatever the confidences (the lengths never look at them).
    The rule runs on the step after, at once on a step that does not
    continue the batch, and on one where the budget would end the episode."""
    ctl = _skip_rule_ctl()
    step, every = _asking(ctl), TUNING.cruise_every
    assert step(1) == (StepPlan("draft", 4), [4], ["rule", "lengths"])
    for i in range(every - 1):
        assert step(5, logit=-6.0 if i % 2 else 6.0) == (StepPlan("draft", 4), [4], [])
    assert step(5)[2] == ["rule", "lengths"]
    assert step(5)[2] == []
    assert step(4)[2] == ["rule", "lengths"]  # not the tokens the lengths scheduled: a prompt chunk, a cut
    assert step(5, ("a", "b"))[2][0] == "rule"  # another batch
    step(1)
    ctl.budget.spent = lambda *a, **k: True
    assert step(5)[2][0] == "rule"


def test_a_verdict_whose_lengths_cut_holds_and_its_lengths_are_asked():
    """Where the lengths verify fewer than the drafted tokens (here the last
    two positions' confidences are low), the verdict still holds for its
    batch, but every step asks the lengths; a probe's verdict (drafting does
    not pay) holds for no step after it, nor does a step's walked deeper than
    its verdict."""
    ctl = _skip_rule_ctl()
    step = _asking(ctl)
    assert step(1, last=-8.0) == (StepPlan("draft", 4), [2], ["rule", "lengths"])
    assert step(3, last=-8.0) == (StepPlan("draft", 4), [2], ["lengths"])
    assert step(3) == (StepPlan("draft", 4), [4], ["lengths"])


    from vllm_dspark.controller.costs import StepCosts
    from vllm_dspark.controller.gate import DraftGate

    def verdict_holds(net: float, once: bool = False) -> bool:
        """Does a drafting step at ``net`` (the drafting model untrusted: a probe every probe_every-th skip) hold?"""
        gate, costs, first = DraftGate(4, TUNING, None), StepCosts(4, TUNING), StepView(("a",), (), (), None, 1, 0, False)
        for _ in range(2 * TUNING.probe_every):  # to the first drafting step: at once, or the probe
            if gate.cruises(first, lambda: True) or gate.drafts(net, 5e-3, 1, first, costs, once=once):
                break
        else:
            raise AssertionError("no step drafted")
        gate.held(first, [4], [4])
        return gate.cruises(StepView(("a",), (), (), None, 5, 0, True), lambda: True)

    assert verdict_holds(1e-3) and not verdict_holds(-1e-3)
    assert not verdict_holds(1e-3, once=True)  # a walk forced deeper than its verdict (survival.py)


def test_walk_is_priced_only_once_measured_or_pinned():
    """Until the walk model has its observations (or a curve pins it), the
    drafting model stands for all of drafting and the walk is K deep; once
    known, drafting is its model plus depth times the walk's."""
    costs = _ctl().costs
    n = TUNING.cost.min_observations
    for _ in range(n):
        costs.draft.observe(2, 8, 2e-3)
    assert costs.draft_seconds(2, 1) == costs.draft_seconds(2, 4) == pytest.approx(2e-3, rel=0.05)
    for _ in range(n):
        costs.walk.observe(2, 0, 3e-4)
    assert costs.draft_seconds(2, 3) == pytest.approx(2e-3 + 3 * 3e-4, rel=0.05)
    # A pinned curve: its "draft" holds the whole walk unless it gives "walk".
    linear = CostParams(5e-3, 0.0, 1e-4)
    costs.pin(CostCurve("c", spec=linear, plain=linear, draft=CostParams(1e-3, 0.0, 0.0)), "c")
    assert costs.draft_seconds(2, 1) == costs.draft_seconds(2, 4) == pytest.approx(1e-3)
    costs.pin(CostCurve("c", spec=linear, plain=linear, draft=CostParams(1e-3, 0.0, 0.0),
                        walk=CostParams(2e-4, 1e-5, 0.0)), "c")
    assert costs.draft_seconds(2, 3) == pytest.approx(1e-3 + 3 * (2e-4 + 2e-5))


def test_walk_time_trains_the_walk_model_and_leaves_the_drafting_model():
    """A drafting step's walk (timed apart by the proposer) trains the walk
    model per position; the drafting model learns the rest."""
    costs = _ctl().costs
    for _ in range(TUNING.cost.min_observations):
        costs.observe(StepSample(4, 12, True, 0.010, 0.003, 4, walk_seconds=0.001, depth=2))
    assert costs.walk.params.predict(4, 0) == pytest.approx(0.0005, rel=0.05)
    assert costs.draft.params.predict(4, 16) == pytest.approx(0.002, rel=0.05)


def test_drafting_is_judged_at_the_best_depth():
    """At 3 ms a position a K-deep walk would not pay, a 2-deep one does:
    the step drafts, 2 deep. A request that may verify only one more token
    (max_tokens) makes the deeper positions certain waste: at 2.5 ms a
    position, 1 deep (it pays there, not at K)."""
    ctl, _ = _depth_ctl(3e-3)
    assert ctl.plan(_Requests(["a"])) == ("draft", 2, frozenset())
    ctl, _ = _depth_ctl(2.5e-3)
    assert ctl.plan(_Requests(["a"], [1])) == ("draft", 1, frozenset())


def test_drafts_in_an_open_batch_are_worth_each_requests_own_steps():
    """Two requests, "a" 60 tokens from its end and "b" 10. Together from
    the start (a wave: closed), the batch ends with "a", and "b"'s 4
    accepted drafts save it nothing. "b" joining while "a" runs (serving:
    open), each request's drafts save its own steps: the mean per request.
    A cohort admitted over two steps (prompts chunked) stays closed; the next
    batch to start from empty is closed again."""
    def saved(ctl) -> float:
        ctl.observe(VerifyOutcome(["a", "b"], [4, 4], [0, 4], [60, 10]))
        return ctl._gained[2]

    wave = _ctl()
    wave.begin_step(_view(("a", "b"), new=("a", "b")))
    wave.begin_step(_view(("a", "b")))
    assert saved(wave) == 0
    chunked = _ctl()
    chunked.begin_step(_view(("a",), new=("a",)))
    chunked.begin_step(_view(("a", "b"), new=("b",)))
    chunked.begin_step(_view(("a", "b")))
    assert saved(chunked) == 0
    served = _ctl()
    served.begin_step(_view(("a",), new=("a",)))
    served.begin_step(_view(("a",)))
    served.begin_step(_view(("a", "b"), new=("b",)))
    assert saved(served) == 2
    served.begin_step(_view(("c", "d"), new=("c", "d")))  # the last batch ended; a new one begins
    assert not served.arrivals.open
