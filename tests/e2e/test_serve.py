"""`vllm serve` with the DSpark JSON and nothing else, queried over HTTP on
loopback: greedy completions equal the offline no-speculation output."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import TARGET_DIR
from tests.e2e.conftest import IDENTITY_TOKENS, TEST_DTYPE, dspark_config
from vllm_dspark.benchmarking import KV_CACHE_BYTES, free_port

pytestmark = pytest.mark.e2e
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(nospec_reference, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", str(TARGET_DIR),
           "--speculative-config", json.dumps(dspark_config(7)),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", TEST_DTYPE,
           "--max-model-len", "512", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
           "--enforce-eager", "--seed", "0"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not come up in {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_greedy_identical(server, identity_prompts, nospec_reference):
    body = {"model": str(TARGET_DIR), "prompt": identity_prompts, "max_tokens": IDENTITY_TOKENS,
            "temperature": 0, "ignore_eos": True}
    resp = requests.post(f"{server}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    texts = [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
    mismatched = [i for i, (a, b) in enumerate(zip(texts, nospec_reference["text"])) if a != b]
    assert len(texts) == len(identity_prompts) and not mismatched, mismatched
    metrics = requests.get(f"{server}/metrics", timeout=30).text
    drafts = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and drafts[0] > 0, "the server must have run speculative decoding"
    # The controller's own metrics ride on the same /metrics (snapshots are
    # written at most every 0.5 s, so allow a moment).
    time.sleep(1.0)
    metrics = requests.get(f"{server}/metrics", timeout=30).text
    for name in ("vllm_dspark:verify_budget_tokens_total", "vllm_dspark:verify_length_bucket",
                 'vllm_dspark:step_time_seconds{kind="predicted"}', "vllm_dspark:cost_model_error_percent",
                 "vllm_dspark:calibration_ece", "vllm_dspark:contextless_requests_total",
                 "vllm_dspark:dormant", "vllm_dspark:plain_steps_total", "vllm_dspark:draft_depth_bucket"):
        assert name in metrics, name
    total = [float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("vllm_dspark:verify_budget_tokens_total")]
    assert total and total[0] > 0


def test_serve_rejects_bad_override_with_400(server, identity_prompts):
    body = {"model": str(TARGET_DIR), "prompt": identity_prompts[0], "max_tokens": 4,
            "vllm_xargs": {"dspark_max_verify": 99}}
    resp = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "dspark_max_verify" in resp.text, resp.text
    ok = requests.post(f"{server}/v1/completions", json={**body, "vllm_xargs": {"dspark_max_verify": 3}}, timeout=60)
    assert ok.status_code == 200, ok.text
