"""policy="threshold": fewer drafted tokens reach verification, greedy output
is unchanged, and vLLM's own counters see the shorter drafts."""

import pytest

from tests.e2e.conftest import assert_exact_with_shorter_blocks, dspark_config, make_llm, stop_engine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(nospec_reference):
    engine = make_llm(speculative_config=dspark_config(7),
                      additional_config={"dspark": {"policy": "threshold", "threshold": 0.3}})
    yield engine
    stop_engine(engine)


def test_threshold_verifies_fewer_tokens_and_stays_exact(llm, identity_prompts, nospec_reference):
    assert_exact_with_shorter_blocks(llm, identity_prompts, nospec_reference)
