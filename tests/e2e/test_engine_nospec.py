"""A real vLLM engine on CPU with the tiny target and no speculation.

vLLM itself discovers the plugin through its entry point and runs register()
inside the engine's worker process; greedy generation is deterministic.
"""

import os

import pytest

pytestmark = pytest.mark.e2e


def test_engine_process_ran_register(nospec_reference):
    (info,) = nospec_reference["workers"]
    assert info["registered"] is True and info["calls"] >= 1
    assert info["pid"] != os.getpid(), "register() must have run in the engine's own process"
    assert info["vllm_version"].startswith("0.32.0")


def test_greedy_is_deterministic(nospec_reference):
    full = nospec_reference["token_ids"]
    again = nospec_reference["second_48"]
    assert again == [t[:48] for t in full[:8]]  # same prompts, another batch shape
    assert nospec_reference["alone_48"] == [t[:48] for t in full[:2]]  # batch of one
    assert all(len(t) == 128 for t in full)
    assert len({tuple(t) for t in full}) == len(full), "distinct prompts should not collapse to one output"
