"""Shared pieces of the end-to-end tests: engine settings, the identity prompt
set, and a no-speculation reference computed once per session (one engine
alive at a time keeps memory and the 2 cores free)."""

import gc
import os

import pytest

from tests.conftest import DRAFTER_DIR, TARGET_DIR

ENGINE_KW = dict(model=str(TARGET_DIR), dtype="bfloat16", max_model_len=512, max_num_seqs=16,
                 gpu_memory_utilization=0.1, enforce_eager=True, seed=0, disable_log_stats=False)
IDENTITY_PROMPTS = 32
IDENTITY_TOKENS = 128


def dspark_config(k: int = 7) -> dict:
    return {"method": "dspark", "model": str(DRAFTER_DIR), "num_speculative_tokens": k}


def greedy_params(max_tokens: int = IDENTITY_TOKENS, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_llm(**kw):
    # collective_rpc ships small lambdas to the worker in these tests.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    return LLM(**{**ENGINE_KW, **kw})


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def spec_counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


@pytest.fixture(scope="session")
def identity_prompts(heldout_prompts) -> list[str]:
    return [p["text"] for p in heldout_prompts[:IDENTITY_PROMPTS]]


@pytest.fixture(scope="session")
def nospec_reference(identity_prompts):
    """Greedy no-speculation outputs (token ids and text) for the identity
    prompts, plus what the plugin-discovery and determinism tests need."""
    llm = make_llm()
    try:
        first = llm.generate(identity_prompts, greedy_params(), use_tqdm=False)
        second = llm.generate(identity_prompts[:8], greedy_params(48), use_tqdm=False)
        alone = [llm.generate([p], greedy_params(48), use_tqdm=False)[0] for p in identity_prompts[:2]]
        workers = llm.collective_rpc(lambda self: __import__("vllm_dspark.plugin").plugin.registration_info())
    finally:
        shutdown(llm)
    return {
        "token_ids": [list(o.outputs[0].token_ids) for o in first],
        "text": [o.outputs[0].text for o in first],
        "second_48": [list(o.outputs[0].token_ids) for o in second],
        "alone_48": [list(o.outputs[0].token_ids) for o in alone],
        "workers": workers,
    }
