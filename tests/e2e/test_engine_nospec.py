"""A real vLLM engine on CPU with the tiny target (one engine for the module).

Checks that vLLM itself discovers the plugin through its entry point and runs
register() inside the engine's worker process, and that greedy generation is
deterministic.
"""

import os

import pytest

from tests.conftest import TARGET_DIR

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm():
    # Lets collective_rpc ship a small lambda to the worker (test-only).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    engine = LLM(model=str(TARGET_DIR), dtype="bfloat16", max_model_len=512, max_num_seqs=8,
                 gpu_memory_utilization=0.15, enforce_eager=True, seed=0)
    yield engine
    del engine


def test_engine_process_ran_register(llm):
    infos = llm.collective_rpc(lambda self: __import__("vllm_dspark.plugin").plugin.registration_info())
    assert len(infos) == 1
    (info,) = infos
    assert info["registered"] is True and info["calls"] >= 1
    assert info["pid"] != os.getpid(), "register() must have run in the engine's own process"
    assert info["vllm_version"].startswith("0.32.0")


def test_greedy_is_deterministic(llm, heldout_prompts):
    from vllm import SamplingParams

    prompts = [p["text"] for p in heldout_prompts[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
    assert first == second
    assert [list(t) for t in alone] == [list(t) for t in first[:2]]
    assert all(len(t) == 48 for t in first)
    assert len({tuple(t) for t in first}) == len(first), "distinct prompts should not collapse to one output"
