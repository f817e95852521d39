"""policy="threshold": fewer drafted tokens reach verification, greedy output
is unchanged, and vLLM's own counters see the shorter drafts."""

import pytest

from tests.e2e.conftest import dspark_config, greedy_params, make_llm, spec_counters, stop_engine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(nospec_reference):
    engine = make_llm(speculative_config=dspark_config(7),
                      additional_config={"dspark": {"policy": "threshold", "threshold": 0.3}})
    yield engine
    stop_engine(engine)


def test_threshold_verifies_fewer_tokens_and_stays_exact(llm, identity_prompts, nospec_reference):
    outs = llm.generate(identity_prompts, greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == nospec_reference["token_ids"]
    c = spec_counters(llm)
    per_draft = c["num_draft_tokens"] / c["num_drafts"]
    accept_rate = c["num_accepted_tokens"] / c["num_draft_tokens"]
    assert 0 < per_draft < 7 * 0.8, per_draft  # "full" verifies exactly 7 per draft
    # The cut-off keeps the tokens most likely to pass: a higher acceptance rate
    # than full blocks (about 0.21 = 1.5 / 7 there).
    assert accept_rate > 0.3, accept_rate

