"""Tensor parallelism (TP=2 on CPU, one core per rank) with a skewed step
clock on rank 1: every rank must make the same decisions (else the drafter's
collectives wait for ever), and greedy output stays that of no-spec. The
engines run in their own process (tp_skew_run.py) under a timeout, so a hang
fails the test instead of holding the suite."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO

SKEW_S = 0.02  # each reading of rank 1's clock 20 ms later than the last: its steps look 20 ms dearer


def test_ranks_agree_under_a_skewed_clock_and_greedy_output_is_no_spec_s():
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_DSPARK_TEST_CLOCK_SKEW_S": str(SKEW_S),
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    run = subprocess.run([sys.executable, str(REPO / "tests" / "e2e" / "tp_skew_run.py")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=360)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["dspark"] == result["nospec"]
    rank0, rank1 = result["snapshots"]
    decided = ("steps", "skipped_steps", "plain_steps", "probe_steps", "dormant", "contextless_requests",
               "length_hist")
    assert {k: rank0[k] for k in decided} == {k: rank1[k] for k in decided}
    # Both kinds of step ran: drafting (collectives in the drafter) and plain.
    assert rank0["steps"] > 0 and rank0["plain_steps"] > 0
