"""The online step-time model on synthetic curves (seeded noise, no timing)."""

import json

import pytest
import torch

from vllm_dspark.controller.cost_model import CostParams, OnlineCostModel, write_saved


def _curve(model, t0, tr, tt, steps, gen, noise=0.03):
    errs = []
    for _ in range(steps):
        r = int(torch.randint(1, 65, (1,), generator=gen))
        b = r * int(torch.randint(1, 9, (1,), generator=gen)) + int(torch.randint(0, 64, (1,), generator=gen))
        true = t0 + tr * r + tt * b
        errs.append(model.observe(r, b, true * (1 + noise * float(torch.randn(1, generator=gen)))))
    return errs


def _max_rel_error(model, t0, tr, tt):
    grid = [(r, r * k) for r in (1, 4, 16, 64) for k in (1, 4, 8)]
    return max(abs(model.params.predict(r, b) - (t0 + tr * r + tt * b)) / (t0 + tr * r + tt * b)
               for r, b in grid)


def test_learns_a_curve_online():
    gen = torch.Generator().manual_seed(0)
    m = OnlineCostModel()
    _curve(m, 4e-3, 2e-4, 6e-5, 400, gen)
    assert _max_rel_error(m, 4e-3, 2e-4, 6e-5) < 0.1
    assert m.mean_abs_pct_error < 10


def test_follows_a_shift():
    """Another process takes the CPU: everything gets 2x slower; the model
    follows within a few hundred steps."""
    gen = torch.Generator().manual_seed(1)
    m = OnlineCostModel()
    _curve(m, 4e-3, 2e-4, 6e-5, 400, gen)
    errs = _curve(m, 8e-3, 4e-4, 1.2e-4, 400, gen)
    assert max(errs[:5]) > 0.3  # the shift is visible...
    assert sum(errs[-100:]) / 100 < 0.06  # ...and learned


def test_no_windup_when_the_load_never_changes():
    """Batch 1 forever (R constant): the fit must stay sane, not drift."""
    gen = torch.Generator().manual_seed(4)
    m = OnlineCostModel()
    for _ in range(3000):
        b = 1 + int(torch.randint(0, 8, (1,), generator=gen))
        m.observe(1, b, (4e-3 + 1.3e-4 * b) * (1 + 0.05 * float(torch.randn(1, generator=gen))))
    assert abs(m.params.predict(1, 4) - (4e-3 + 1.3e-4 * 4)) / 4.5e-3 < 0.05
    assert m.mean_abs_pct_error < 10


def test_covers_a_batch_size_class_seen_lately_outside_the_window_of_the_mean():
    """Light arrivals: plain steps at 4 requests for a while, then a few at 1.
    The window around the decayed mean (about 3.9, two standard deviations
    about 1.2) holds neither 1 nor 2; 1 was seen lately, in its own power-of-two
    class, so its cost is no extrapolation; 2 (the class of 2-3) was never seen,
    and what was seen fades away."""
    m = OnlineCostModel()
    for _ in range(200):
        m.observe(4, 4, 6e-3)
    assert not m.covers(1) and not m.covers(1, 1) and not m.covers(2, 2)
    for _ in range(3):
        m.observe(1, 1, 5e-3)
    assert m.covers(1) and m.covers(1, 1) and m.covers(4, 4)
    assert not m.covers(2, 2) and not m.covers(1, 40)  # another class of tokens
    for _ in range(300):  # steps at 16 requests: what was seen at 1 fades
        m.observe(16, 16, 9e-3)
    assert not m.covers(1, 1)


def test_a_run_of_steps_weighs_as_that_many_steps():
    """A coasting run's mean step (observe with ``steps``) counts as its
    steps: between runs of 8 plain steps at 4 ms, one step in 9 at 6 ms (the
    rule's, or a fresh engine's slow start) moves the price by its share, 4.2
    ms, not to the middle of the two, 5 ms, as it did weighed one to one."""
    weighed, flat = OnlineCostModel(), OnlineCostModel()
    for _ in range(40):
        for m, steps in ((weighed, 8), (flat, 1)):
            m.observe(1, 1, 6e-3)
            m.observe(1, 1, 4e-3, steps)
    assert weighed.params.predict(1, 1) == pytest.approx((6e-3 + 8 * 4e-3) / 9, rel=0.03)
    assert flat.params.predict(1, 1) == pytest.approx(5e-3, rel=0.03)


def test_ignores_stalls():
    gen = torch.Generator().manual_seed(2)
    m = OnlineCostModel()
    _curve(m, 4e-3, 2e-4, 6e-5, 200, gen)
    before = m.params
    for _ in range(5):
        m.observe(16, 64, 1.0)  # a 1 s stall
    assert abs(m.params.t0 - before.t0) / before.t0 < 0.01


def test_persists_under_fingerprint(tmp_path):
    gen = torch.Generator().manual_seed(3)
    m = OnlineCostModel("abc", tmp_path)
    _curve(m, 4e-3, 2e-4, 6e-5, 300, gen)
    write_saved([m.saved()])
    again = OnlineCostModel("abc", tmp_path)
    assert again.loaded_from and _max_rel_error(again, 4e-3, 2e-4, 6e-5) < 0.1
    assert OnlineCostModel("other", tmp_path).loaded_from is None
    (tmp_path / "cost_model_abc.json").write_text(json.dumps({"schema_version": 2, "fingerprint": "abc",
                                                              "xtx": [1, 2], "xty": []}))
    assert OnlineCostModel("abc", tmp_path).loaded_from is None  # damaged: ignored, not fatal


def test_a_save_leaves_the_writing_to_a_thread_and_drops_a_save_while_one_writes(tmp_path, monkeypatch):
    """StepCosts.save returns before its files are written (the step goes
    on), writes every model's fit as it was when asked, and skips a save
    asked while the last one still writes."""
    import threading

    from vllm_dspark.controller import costs as costs_module
    from vllm_dspark.controller.costs import StepCosts
    from vllm_dspark.controller.tuning import ControllerTuning

    release, calls = threading.Event(), []

    def held_write(saved):
        calls.append(saved)
        release.wait(10)
        write_saved(saved)

    monkeypatch.setattr(costs_module, "write_saved", held_write)
    costs = StepCosts(4, ControllerTuning(), fingerprint="fp", cache_dir=tmp_path)
    _curve(costs.plain, 4e-3, 2e-4, 6e-5, 300, torch.Generator().manual_seed(4))
    asked = costs.plain.saved()[1]
    costs.save()
    _curve(costs.plain, 8e-3, 2e-4, 6e-5, 50, torch.Generator().manual_seed(5))  # learns on meanwhile
    costs.save()  # the first still writes: dropped
    assert len(calls) == 1 and not list(tmp_path.glob("*.json"))
    release.set()
    costs._writer.join(10)
    written = json.loads((tmp_path / "cost_model_fp-plain.json").read_text())
    assert written["xtx"] == asked["xtx"] and written["xty"] == asked["xty"]
    assert len(list(tmp_path.glob("cost_model_fp-*.json"))) == 6
    assert OnlineCostModel("fp-plain", tmp_path).loaded_from


def test_cost_curve_round_trip_and_defaults(tmp_path):
    from vllm_dspark.controller.cost_curve import FREE, CostCurve, load_cost_curve

    curve = CostCurve("x", CostParams(0.01, 1e-4, 2e-4), CostParams(0.009, 1e-4, 1e-4), CostParams(0.001, 0.0, 3e-5))
    curve.save(tmp_path / "c.json")
    assert load_cost_curve(tmp_path / "c.json") == curve
    walked = CostCurve("w", curve.spec, curve.plain, curve.draft, walk=CostParams(2e-4, 1e-6, 0.0))
    walked.save(tmp_path / "w.json")
    assert load_cost_curve(tmp_path / "w.json") == walked and curve.walk is None
    (tmp_path / "s.json").write_text('{"spec": {"t0": 0.01, "t_req": 0, "t_tok": 0.001}}')
    only_spec = load_cost_curve(tmp_path / "s.json")
    assert only_spec.plain == only_spec.spec and only_spec.draft == FREE
    (tmp_path / "bad.json").write_text('{"spec": {"t0": 0.01, "t_req": 0, "t_tok": 0.001}, "drafts": {}}')
    with pytest.raises(ValueError, match=r"unknown keys \['drafts'\]"):
        load_cost_curve(tmp_path / "bad.json")


def test_pinned_model_predicts_the_curve_and_does_not_learn():
    model = OnlineCostModel()
    model.pin(CostParams(0.01, 0.0, 0.001), "test")
    for _ in range(50):
        model.observe(4, 4, 0.5)
    assert model.params == CostParams(0.01, 0.0, 0.001) and model.mean_abs_pct_error > 90


def test_a_verified_token_is_priced_by_the_plain_slope_until_verify_steps_vary():
    """Batch 1, whole blocks: verify steps all carry 8 tokens, so their own
    slope is not identified (fits to about 0) and would verify every block
    whole. Plain steps with prompts (1 or 1 + 48 tokens) identify it: that
    price stands in. Once verify steps vary, their own fit decides. Seeded
    noise (3%, seed 0), no timing."""
    from vllm_dspark.controller.clock import StepSample
    from vllm_dspark.controller.costs import StepCosts
    from vllm_dspark.controller.tuning import ControllerTuning

    gen = torch.Generator().manual_seed(0)
    costs = StepCosts(7, ControllerTuning())
    t0, plain_tok, verify_tok = 5e-3, 3e-4, 1e-4

    def step(tokens, verifies, per_token):
        seconds = (t0 + per_token * tokens) * (1 + 0.03 * float(torch.randn(1, generator=gen)))
        costs.observe(StepSample(1, tokens, verifies, seconds, 0.0, 0))

    for i in range(200):
        step(49 if i % 8 == 0 else 1, False, plain_tok)
        step(8, True, verify_tok)
    assert costs.verify.token_spread() < ControllerTuning().min_token_spread
    assert costs.verify.params.t_tok < plain_tok / 3  # what verify steps alone say
    assert costs.token_cost() == pytest.approx(plain_tok, rel=0.2)
    assert costs.predict(1, 0, 7).per_token == costs.token_cost()
    for i in range(400):  # verify lengths now vary: 1 + 0..7 tokens
        step(1 + int(torch.randint(0, 8, (1,), generator=gen)), True, verify_tok)
    assert costs.token_cost() == pytest.approx(verify_tok, rel=0.3)


def test_a_step_shape_s_first_run_is_learned_by_no_model_of_that_shape():
    """The first step of a shape (its target's token count, verifying or not;
    its drafter's blocks at its depth) carries the machine's one-time warm-up
    for it: on the AMD EPYC x2 the first verify steps at 8 tokens took 8.4 ms
    against 4.7 ms after, the drafter's first step 25 ms against 3 ms. The
    controller asks first_run; each model skips only its own shape's first
    run (skipping the whole step for either, a short run's drafting model
    learned nothing: every drafting step was new in one or the other)."""
    from vllm_dspark.controller.clock import StepSample
    from vllm_dspark.controller.costs import StepCosts
    from vllm_dspark.controller.tuning import ControllerTuning

    costs = StepCosts(7, ControllerTuning())
    verify = StepSample(1, 8, True, 0.0047, 0.003, 1, walk_seconds=0.0002, depth=7, draft_tokens=7)
    assert costs.first_run(verify) == (True, True) and costs.first_run(verify) == (False, False)
    assert costs.first_run(verify._replace(tokens=6, draft_tokens=5)) == (True, False)  # a new token count
    assert costs.first_run(verify._replace(depth=5)) == (False, True)  # the drafter at a new depth
    assert costs.first_run(verify._replace(verifies=False)) == (True, False)  # a plain step of 8 tokens: another path
    assert costs.first_run(verify._replace(seconds=0.025)) == (False, False)  # the time is no part of the shape
    models = (costs.verify, costs.plain, costs.draft, costs.walk, costs.nospec, costs.decode)
    before = [m.observations for m in models]
    predicted = costs.observe(verify._replace(seconds=0.025), (True, True))
    assert [m.observations for m in models] == before
    assert predicted == costs.observe(verify)  # the same prediction, learned this time
    assert costs.verify.observations == before[0] + 1
    costs.observe(verify._replace(depth=3), (False, True))  # only the drafter's shape is new
    assert (costs.verify.observations, costs.draft.observations) == (before[0] + 2, before[2] + 1)
    costs.observe(verify._replace(tokens=5), (True, False))  # only the target's
    assert (costs.verify.observations, costs.draft.observations) == (before[0] + 2, before[2] + 2)


def test_a_cache_that_cannot_be_written_is_warned_about_not_fatal(tmp_path, caplog):
    """The cache folder's parent is a file: the save warns, naming the folder
    and the fix, once, and raises nothing (it runs in the writer thread)."""
    import logging

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    m = OnlineCostModel("abc", blocker / "cache")
    with caplog.at_level(logging.WARNING):
        write_saved([m.saved()])
        write_saved([m.saved()])  # the next save: not warned about again
    assert "VLLM_DSPARK_CACHE_DIR" in caplog.text and str(blocker / "cache") in caplog.text
    assert caplog.text.count("not saved to") == 1
    assert not list(tmp_path.rglob("*.tmp"))
