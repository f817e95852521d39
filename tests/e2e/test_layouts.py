"""Every checkpoint layout the plugin loads (layouts.py), end to end through
LLM(): the tiny drafter converted to each (convert.py), policy "full" so
every drafted token is verified and the counters compare. Native weights come
from a hub id in a fake Hugging Face cache (its own process: the cache
location is read when huggingface_hub is imported); the trainer and
speculators layouts (bit-identical weights) must draft and accept exactly as
it does; the reduced draft vocabulary keeps its acceptance within a stated
margin and passes the sampled-distribution test."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import DRAFTER_DIR, REPO, TARGET_DIR
from tests.e2e.conftest import (IN_PROCESS_ENV, assert_second_token_follows_target, greedy_params, make_llm,
                                spec_counters, stop_engine)
from vllm_dspark.convert import convert

pytestmark = pytest.mark.e2e

PROMPTS, TOKENS = 16, 64
HUB_ID = "dspark-test/tiny-qwen3-dspark-block7"
REDUCED_VOCAB = 1024  # of 2048
# Accepted tokens per drafted block with the reduced vocabulary, at least this
# share of the full vocabulary's (measured here: 301 against 303 over these
# 16 x 64 greedy tokens, float32, AMD EPYC; the 1,024 ids kept cover 91% of
# the training text's tokens).
REDUCED_ACCEPTANCE_MARGIN = 0.90
COUNTED = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _fake_hub_cache(root):
    """``HUB_ID`` in Hugging Face's cache layout, holding the native drafter."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in DRAFTER_DIR.iterdir():
        if f.is_file() and f.name != "training_report.json":
            (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


@pytest.fixture(scope="module")
def hub_native(tmp_path_factory):
    cache = _fake_hub_cache(tmp_path_factory.mktemp("hf_cache"))
    env = {**os.environ, **IN_PROCESS_ENV, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    run = subprocess.run([sys.executable, str(REPO / "tests" / "e2e" / "hub_id_run.py"), HUB_ID, str(PROMPTS),
                          str(TOKENS)], env=env, cwd=REPO, capture_output=True, text=True, timeout=420)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["cache"] = str(cache)
    return result


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {
        "trainer": convert(str(DRAFTER_DIR), str(root / "trainer"), "trainer", target=str(TARGET_DIR)),
        "speculators": convert(str(DRAFTER_DIR), str(root / "speculators"), "speculators"),
        "reduced": convert(str(DRAFTER_DIR), str(root / "reduced"), "speculators", draft_vocab=REDUCED_VOCAB),
    }


def _run(path, reference):
    """Greedy output (checked against no-spec) and the spec counters."""
    llm = make_llm(speculative_config={"method": "dspark", "model": str(path), "num_speculative_tokens": 7},
                   additional_config={"dspark": {"policy": "full"}})
    try:
        outs = llm.generate(reference["prompts"], greedy_params(TOKENS), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == reference["ids"]
        return llm, {k: spec_counters(llm)[k] for k in COUNTED}
    except BaseException:
        stop_engine(llm)
        raise


@pytest.fixture(scope="module")
def reference(identity_prompts, nospec_reference):
    return {"prompts": identity_prompts[:PROMPTS], "ids": [t[:TOKENS] for t in nospec_reference["token_ids"][:PROMPTS]]}


def test_hub_id_resolves_from_the_cache_and_output_is_no_spec(hub_native, reference):
    assert hub_native["drafter_path"] == HUB_ID
    assert hub_native["token_ids"] == reference["ids"]
    assert hub_native["counters"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("layout", ["trainer", "speculators"])
def test_full_vocabulary_layouts_draft_and_accept_as_native(layout, converted, hub_native, reference):
    llm, counters = _run(converted[layout], reference)
    stop_engine(llm)
    assert counters == {k: hub_native["counters"][k] for k in COUNTED}


def test_reduced_draft_vocabulary_keeps_acceptance(converted, hub_native, reference):
    llm, counters = _run(converted["reduced"], reference)
    stop_engine(llm)
    native = hub_native["counters"]
    per_block = counters["num_accepted_tokens"] / counters["num_drafts"]
    native_per_block = native["num_accepted_tokens"] / native["num_drafts"]
    assert per_block >= REDUCED_ACCEPTANCE_MARGIN * native_per_block, (counters, native)


def test_k_below_the_block_with_a_reduced_vocabulary_stays_lossless(converted, reference, heldout_prompts):
    """K=3 with the block-7 drafter drafts a 3-position block, here over the
    reduced vocabulary (so one sampled test covers both: the draft
    probabilities placed at target ids, from a shorter block): greedy output
    is no-spec's and sampled output follows the target (seed 0, 2,000
    requests, chi-square at T=1, top-p 0.95, false-failure rate 2e-4)."""
    llm = make_llm(speculative_config={"method": "dspark", "model": str(converted["reduced"]),
                                       "num_speculative_tokens": 3},
                   additional_config={"dspark": {"policy": "full"}})
    try:
        outs = llm.generate(reference["prompts"], greedy_params(TOKENS), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == reference["ids"]
        c = spec_counters(llm)
        assert 0 < c["num_draft_tokens"] <= 3 * c["num_drafts"]
        assert assert_second_token_follows_target(llm, heldout_prompts[1]["text"], 1.0, 0.95) > 0
    finally:
        stop_engine(llm)
