"""When speculation cannot pay (here: an SLO no step can meet), the controller
skips the drafter; the drafter still takes in each step's context, and greedy
output stays exact."""

import pytest

from tests.e2e.conftest import dspark_config, greedy_params, make_llm, stop_engine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(nospec_reference):
    engine = make_llm(speculative_config=dspark_config(7), additional_config={"dspark": {"slo_tokens_per_s": 1e6}})
    yield engine
    stop_engine(engine)


def test_skipping_drafts_stays_exact(llm, identity_prompts, nospec_reference):
    outs = llm.generate(identity_prompts[:16], greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == nospec_reference["token_ids"][:16]
    snap = llm.collective_rpc("dspark_snapshot")[0]
    assert snap["budget_tokens_total"] == 0  # a 1 us step budget admits no draft
    assert snap["skipped_steps"] > 0.7 * snap["steps"], snap  # all but the probe steps skip drafting
