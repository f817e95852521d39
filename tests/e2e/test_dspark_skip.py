"""When speculation cannot pay (here: an SLO no step can meet), the controller
skips the drafter; the drafter still takes in each step's context, and greedy
output stays exact. Once dormant, steps run as steps without speculation,
requests keep no drafter context, no KV slots are reserved for drafts, and
output stays exact."""

import pytest

from tests.e2e.conftest import dspark_config, greedy_params, make_llm, stop_engine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(nospec_reference):
    # Dormant after a single skipped step (and a test holds it dormant).
    engine = make_llm(speculative_config=dspark_config(7),
                      additional_config={"dspark": {"slo_tokens_per_s": 1e6, "dormant_after_steps": 1}})
    yield engine
    stop_engine(engine)


def test_skipping_drafts_stays_exact(llm, identity_prompts, nospec_reference):
    outs = llm.generate(identity_prompts[:16], greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == nospec_reference["token_ids"][:16]
    snap = llm.collective_rpc("dspark_snapshot")[0]
    assert snap["budget_tokens_total"] == 0  # a 1 us step budget admits no draft
    assert snap["skipped_steps"] > 0.7 * snap["steps"], snap  # all but the probe steps skip drafting


def _hold_dormant(worker) -> bool:
    ctl = worker.model_runner.dspark
    ctl.dormancy.sleep()
    # In debt, and held: a batch size's first priced step grants a reserve (budget.py), which would wake it.
    ctl.budget.balance = -1e9
    ctl.dormancy.wake = lambda: None
    return True


def test_requests_admitted_while_dormant_are_never_drafted(llm, identity_prompts, nospec_reference):
    llm.collective_rpc(_hold_dormant)
    before = llm.collective_rpc("dspark_snapshot")[0]
    assert before["dormant"]
    outs = llm.generate(identity_prompts[16:32], greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == nospec_reference["token_ids"][16:32]
    after = llm.collective_rpc("dspark_snapshot")[0]
    assert after["contextless_requests"] - before["contextless_requests"] == 16
    skipped = after["skipped_steps"] - before["skipped_steps"]
    plain = after["plain_steps"] - before["plain_steps"]
    drafted = after["steps"] - before["steps"]
    probes = after["probe_steps"] - before["probe_steps"]  # awake, without drafts (awake.py)
    # Every step of the batch ran without speculation's paths but the probes, and none drafted.
    assert skipped >= 100 and plain + probes == skipped and probes < skipped // 8 and drafted == 0, (
        skipped, plain, probes, drafted)
    assert _scheduler(llm).num_lookahead_tokens == 0  # no KV slots reserved for drafts meanwhile


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler  # an in-process engine (make_llm)


def _end_dormancy_drafting_every_step(worker) -> bool:
    from vllm_dspark.controller.policies import FullPolicy

    ctl = worker.model_runner.dspark
    ctl.policy = FullPolicy()
    vars(ctl.dormancy).pop("wake", None)  # no longer held
    ctl.dormancy.dormant = False
    return True


def test_drafting_resumes_after_dormant_steps(llm, identity_prompts, nospec_reference):
    """Once dormancy ends (forced here, with policy full from then on), steps
    take the speculative paths again: new requests are admitted with context,
    drafted and verified, and output stays exact."""
    llm.collective_rpc(_end_dormancy_drafting_every_step)
    before = llm.collective_rpc("dspark_snapshot")[0]
    outs = llm.generate(identity_prompts[:16], greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == nospec_reference["token_ids"][:16]
    after = llm.collective_rpc("dspark_snapshot")[0]
    assert after["plain_steps"] == before["plain_steps"]
    assert after["contextless_requests"] == before["contextless_requests"]
    assert after["verified_blocks"] - before["verified_blocks"] >= 16 * 8
    assert after["accepted_tokens"] > before["accepted_tokens"]
    scheduler = _scheduler(llm)  # slots for drafts reserved again, as vLLM reserves them
    assert scheduler.num_lookahead_tokens == llm.llm_engine.vllm_config.num_lookahead_tokens > 0


def _wake(llm) -> None:
    """Dormancy ended from outside, with the draft slots the scheduler
    reserves once the runner reports a waking controller: without them the
    first step would skip, and the passes below would differ by it."""
    llm.collective_rpc(_end_dormancy_drafting_every_step)
    scheduler = _scheduler(llm)
    scheduler.num_lookahead_tokens = llm.llm_engine.vllm_config.num_lookahead_tokens


def _counters(llm) -> dict:
    snap = llm.collective_rpc("dspark_snapshot")[0]
    hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    return {"contextless": snap["contextless_requests"], "blocks": snap["verified_blocks"],
            "accepted": snap["accepted_tokens"], "hits": hits}


def test_prefix_cache_hits_keep_the_drafter_context_right(llm, heldout_prompts):
    """Prompts over two 128-token blocks, each sent twice. Computed while
    dormant, their blocks hold no drafter context: the repeats hit the cache
    and are admitted without context (never drafted), output unchanged.
    Computed while drafting, the repeats hit, draft from the cached context
    and accept as much per block as the first pass (policy full, greedy,
    float32: equal here; the 2% margin allows one token's rounding)."""
    texts = [" ".join(p["text"] for p in heldout_prompts[40 + 7 * i: 47 + 7 * i]) for i in range(8)]
    params = greedy_params(48)

    def run(prompts):
        before = _counters(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = _counters(llm)
        return [list(o.outputs[0].token_ids) for o in outs], {k: after[k] - before[k] for k in after}

    llm.collective_rpc(_hold_dormant)
    dormant_ids, dormant = run(texts[:4])
    _wake(llm)
    stale_ids, stale = run(texts[:4])
    assert stale_ids == dormant_ids
    assert stale["hits"] > 0 and stale["contextless"] == 4 and stale["blocks"] == 0, stale
    # Steps where no request had context ran plain, and their rule may have
    # slept again: wake it as before.
    _wake(llm)
    first_ids, first = run(texts[4:])
    again_ids, again = run(texts[4:])
    assert again_ids == first_ids
    assert again["hits"] > 0 and again["contextless"] == 0 and first["blocks"] > 0, (first, again)
    assert again["accepted"] / again["blocks"] >= 0.98 * first["accepted"] / first["blocks"], (first, again)
