"""`vllm serve` with the DSpark JSON and nothing else, queried over HTTP on
loopback, next to a server without speculation; both with a KV cache small
enough that vLLM preempts. Greedy completions equal the offline no-spec
output; a bounded soak (fixed request counts, stops by itself) mixes greedy
requests with logprobs, sampled ones, n>1, structured output (choice and
regex), streams the client aborts and repeated long prefixes, and checks
that nothing fails, greedy text and logprobs equal the no-spec server's,
vLLM preempted, prefix-cache hits are no-spec's, and the server is healthy."""

import contextlib
import json
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import TARGET_DIR
from tests.e2e.conftest import IDENTITY_TOKENS, TEST_DTYPE, dspark_config
from vllm_dspark.benchmarking import server_metric, start_server, stop_server

pytestmark = pytest.mark.e2e
STARTUP_TIMEOUT_S = 300
# 6 MiB of KV: 1,024 tokens (8 blocks of 128) with the drafter's layers,
# 1,536 without; 12 concurrent requests of 48 + 96 tokens need 24 blocks.
SOAK_KV_BYTES = 6 << 20
MODEL = str(TARGET_DIR)
LOGS: dict[str, Path] = {}  # server URL -> its log


@contextlib.contextmanager
def _serve(spec: dict | None, log: Path):
    args = ["--dtype", TEST_DTYPE, "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", str(SOAK_KV_BYTES), "--enforce-eager", "--seed", "0"]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    try:
        server = start_server(MODEL, args, log, timeout_s=STARTUP_TIMEOUT_S)
    except RuntimeError as e:
        pytest.fail(str(e))
    LOGS[server[1]] = log
    try:
        yield server[1]
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def server(nospec_reference, tmp_path_factory):
    with _serve(dspark_config(7), tmp_path_factory.mktemp("serve") / "dspark.log") as base:
        yield base


@pytest.fixture(scope="module")
def nospec_server(tmp_path_factory):
    with _serve(None, tmp_path_factory.mktemp("serve") / "nospec.log") as base:
        yield base


def _complete(base: str, **body) -> dict:
    resp = requests.post(f"{base}/v1/completions", json={"model": MODEL, **body}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_serve_greedy_identical(server, identity_prompts, nospec_reference):
    out = _complete(server, prompt=identity_prompts, max_tokens=IDENTITY_TOKENS, temperature=0, ignore_eos=True)
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    mismatched = [i for i, (a, b) in enumerate(zip(texts, nospec_reference["text"])) if a != b]
    assert len(texts) == len(identity_prompts) and not mismatched, mismatched
    assert server_metric(server, "vllm:spec_decode_num_drafts_total") > 0, "the server must have run speculative decoding"
    # The controller's own metrics ride on the same /metrics: each scrape asks
    # the worker for a snapshot and waits for it (metrics.py).
    metrics = requests.get(f"{server}/metrics", timeout=30).text
    for name in ("vllm_dspark:verify_budget_tokens_total", "vllm_dspark:verify_length_bucket",
                 'vllm_dspark:step_time_seconds{kind="predicted"}', "vllm_dspark:cost_model_error_percent",
                 "vllm_dspark:calibration_ece", "vllm_dspark:contextless_requests_total",
                 "vllm_dspark:dormant", "vllm_dspark:plain_steps_total", "vllm_dspark:draft_depth_bucket",
                 'vllm_dspark:machine_pace{kind="trust"}'):
        assert name in metrics, name
    # vLLM counted drafts, so the controller chose lengths: its counter shows
    # them (in make test, with snapshots every 0.5 s, one scrape a second
    # after the traffic read 0: polled; a first read of 0 is a warning).
    first = chosen = server_metric(server, "vllm_dspark:verify_budget_tokens_total")
    deadline = time.monotonic() + 10
    while chosen == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        chosen = server_metric(server, "vllm_dspark:verify_budget_tokens_total")
    assert chosen > 0
    if first == 0:
        warnings.warn("the first scrape after the traffic read verify_budget_tokens_total 0; a later one did not")


def test_serve_rejects_bad_override_with_400(server, identity_prompts):
    body = {"model": MODEL, "prompt": identity_prompts[0], "max_tokens": 4, "vllm_xargs": {"dspark_max_verify": 99}}
    resp = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "dspark_max_verify" in resp.text, resp.text
    ok = requests.post(f"{server}/v1/completions", json={**body, "vllm_xargs": {"dspark_max_verify": 3}}, timeout=60)
    assert ok.status_code == 200, ok.text


def _aborted_stream(base: str, prompt: str) -> int:
    """A stream the client drops after three chunks; returns the chunks read."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0.7, "stream": True}
    read = 0
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line:
                read += 1
            if read >= 3:
                break
    return read


def _soak(base: str, prompts: list[str], long_prompts: list[str]) -> dict:
    """The fixed mix, concurrently; returns what must match across servers."""
    greedy = dict(max_tokens=96, temperature=0, ignore_eos=True, logprobs=2)
    jobs = {f"greedy{i}": (_complete, dict(prompt=p, **greedy)) for i, p in enumerate(prompts[:12])}
    jobs |= {f"sampled{i}": (_complete, dict(prompt=p, max_tokens=40, temperature=1.0, top_p=0.95, seed=i,
                                              ignore_eos=True)) for i, p in enumerate(prompts[12:18])}
    jobs |= {f"n2_{i}": (_complete, dict(prompt=p, n=2, max_tokens=24, temperature=0.8, ignore_eos=True))
             for i, p in enumerate(prompts[18:20])}
    jobs["choice"] = (_complete, dict(prompt=prompts[20], max_tokens=8, temperature=0,
                                      structured_outputs={"choice": ["alpha", "beta", "gamma"]}))
    jobs["regex"] = (_complete, dict(prompt=prompts[21], max_tokens=16, temperature=0,
                                     structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"}))
    with ThreadPoolExecutor(len(jobs) + 4) as pool:
        aborted = [pool.submit(_aborted_stream, base, p) for p in prompts[22:26]]
        futures = {name: pool.submit(fn, base, **kw) for name, (fn, kw) in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
        assert all(a.result() == 3 for a in aborted)
    for i in range(6):
        assert results[f"sampled{i}"]["usage"]["completion_tokens"] == 40
    for i in range(2):
        assert len(results[f"n2_{i}"]["choices"]) == 2
        assert results[f"n2_{i}"]["usage"]["completion_tokens"] == 48
    assert results["choice"]["choices"][0]["text"] in ("alpha", "beta", "gamma")
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", results["regex"]["choices"][0]["text"]), results["regex"]
    hits_before = server_metric(base, "vllm:prefix_cache_hits_total")
    repeated = []
    for _ in range(2):  # the second pass hits the first's blocks
        repeated.append([_complete(base, prompt=p, max_tokens=32, temperature=0, ignore_eos=True)["choices"][0]["text"]
                         for p in long_prompts])
    assert repeated[0] == repeated[1]
    return {"greedy": {k: (results[k]["choices"][0]["text"], results[k]["choices"][0]["logprobs"]["top_logprobs"])
                       for k in results if k.startswith("greedy")},
            "structured": (results["choice"]["choices"][0]["text"], results["regex"]["choices"][0]["text"]),
            "repeated": repeated[0],
            "hits": server_metric(base, "vllm:prefix_cache_hits_total") - hits_before,
            "preemptions": server_metric(base, "vllm:num_preemptions_total")}


def test_serving_soak_matches_no_spec(server, nospec_server, heldout_prompts):
    prompts = [p["text"] for p in heldout_prompts[32:58]]
    # Long prompts (about 340 tokens, over two 128-token blocks) for the prefix cache.
    long_prompts = [" ".join(p["text"] for p in heldout_prompts[60 + 7 * i: 67 + 7 * i]) for i in range(3)]
    want = _soak(nospec_server, prompts, long_prompts)
    got = _soak(server, prompts, long_prompts)
    print(f"soak: hits {got['hits']:.0f} (no-spec {want['hits']:.0f}), preemptions {got['preemptions']:.0f} "
          f"(no-spec {want['preemptions']:.0f})")
    assert got["greedy"].keys() == want["greedy"].keys()
    for name in want["greedy"]:
        assert got["greedy"][name][0] == want["greedy"][name][0], name
        assert got["greedy"][name][1] == want["greedy"][name][1], name  # logprobs, bit for bit
    assert got["structured"] == want["structured"] and got["repeated"] == want["repeated"]
    assert got["preemptions"] > 0, "the soak must run under KV pressure"
    assert want["hits"] > 0 and got["hits"] >= 0.95 * want["hits"], (got["hits"], want["hits"])
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
    assert server_metric(server, "vllm:spec_decode_num_drafts_total") > 0
    errors = [line for line in LOGS[server].read_text().splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, errors[:5]
