"""The benchmark's head-to-head phase and the target verdict built on it
(no engines: measure_offline is replaced by fixed rates per engine)."""

import importlib.util
from pathlib import Path

import pytest

from vllm_dspark import benchmarking
from vllm_dspark.benchmarking import ThroughputSample


def _bench_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dspark.py"
    spec = importlib.util.spec_from_file_location("bench_dspark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_head_to_head_alternates_order_and_keeps_each_engines_rate(monkeypatch):
    calls = []

    def fake_measure(llm, prompts, concurrency, max_tokens):
        calls.append(llm)
        rate = {"a": 90.0, "b": 100.0}[llm]
        return ThroughputSample(concurrency, len(prompts), int(rate), 1.0)

    monkeypatch.setattr(benchmarking, "measure_offline", fake_measure)
    pairs = benchmarking.measure_head_to_head("a", "b", ["p"] * 64, 16, 8, pairs=4)
    # ABBA (drift favours neither); a round right after the other engine's is run once unmeasured first
    assert calls == ["a", "a", "b", "b", "b", "a", "a", "a", "b", "b", "b", "a", "a"]
    assert pairs == [(90.0, 100.0)] * 4  # (first's, second's) whichever ran first
    calls.clear()
    assert benchmarking.measure_head_to_head("a", "b", ["p"] * 64, 16, 8, pairs=4, settle=False) == pairs
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # every round measured


def test_take_turns_alternates_order_and_keeps_each_engines_batches():
    """Live engines take each batch in turn, ABBA (drift favours neither), and
    each keeps its own outputs and one time per batch."""
    calls = []

    class Engine:
        def __init__(self, name):
            self.name = name

        def generate(self, batch, params, use_tqdm):
            calls.append(self.name)
            return [f"{self.name}:{p}" for p in batch]

    seconds, outputs = benchmarking.take_turns([Engine("a"), Engine("b")], [["p0"], ["p1"], ["p2", "p3"]], None)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert outputs == [["a:p0", "a:p1", "a:p2", "a:p3"], ["b:p0", "b:p1", "b:p2", "b:p3"]]
    assert [len(s) for s in seconds] == [3, 3] and all(t >= 0 for s in seconds for t in s)


def _arms(adaptive_rounds, nospec_rounds):
    import statistics

    def rows(rounds):
        return [{"concurrency": 16, "tokens_per_s": statistics.median(rounds), "rounds_tokens_per_s": rounds}]

    return {"nospec": rows(nospec_rounds), "dspark-k7": rows([50.0] * 3), "dspark-adaptive": rows(adaptive_rounds)}


@pytest.mark.parametrize("duel_ratio, verdict", [(0.99, "OK"), (0.95, "MISS")])
def test_verdict_uses_the_head_to_head_where_run(duel_ratio, verdict):
    bench = _bench_module()
    arms = _arms([90.0, 91.0, 92.0], [100.0] * 3)  # sweep: about 0.91x no-spec
    assert bench.best_other(arms) == {16: "nospec"}
    assert bench.check_targets(arms)["lines"][0].endswith("MISS")
    pairs = [(duel_ratio * 100.0, 100.0)] * 5
    duel = {16: {"against": "nospec", "pairs": pairs, "median": duel_ratio,
                 "interval90": bench.bootstrap_median_interval([a / b for a, b in pairs])}}
    out = bench.check_targets(arms, duel)
    assert out["verdict_ratio"][16] == duel_ratio
    assert out["lines"][0].endswith(verdict)
    assert out["vs_best_other_per_round"][16] == pytest.approx(0.91)  # still reported


def test_published_results_are_the_latest_runs():
    """The README's matrix summaries and docs/benchmarks.md's matrix and sweep
    tables (each host's matrix) are generated from benchmarks/results/latest/ (regenerate:
    bench_matrix.summary_table and matrix_table, bench_dspark.results_table
    on those records)."""
    import json
    import sys

    repo = Path(__file__).resolve().parents[1]
    bench = _bench_module()
    latest = repo / "benchmarks" / "results" / "latest"
    record = json.loads((latest / "dspark_vs_nospec.json").read_text())
    assert bench.results_table(record) in (repo / "docs" / "benchmarks.md").read_text()
    sys.path.insert(0, str(repo / "benchmarks"))
    from bench_matrix import matrix_table, summary_table

    readme, docs = (repo / "README.md").read_text(), (repo / "docs" / "benchmarks.md").read_text()
    for host in ("matrix.json", "matrix_xeon.json"):  # the AMD hosts' cells, the Intel host's
        matrix = json.loads((latest / host).read_text())
        assert summary_table(matrix) in readme, host
        assert matrix_table(matrix) in docs, host


def test_a_per_round_cell_takes_each_runs_best_other_arm_from_the_other_runs():
    """Two runs where adaptive ties every arm but one lucky arm per run (K=3
    in run 1, no-spec in run 2). Against the arm best over both runs' rounds
    (K=3), adaptive reads 0.9x; against the arm the other run found best, it
    ties, as it does."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_matrix import AD, K7, NS, summarize

    def run(k3: float, nospec: float) -> dict:
        rounds = [{NS: nospec, K7: 1.0, "dspark-k3": k3, AD: 1.0}] * 2
        return {"rows": {"tok/s": {"rounds": rounds, "integrity": {}}}, "identity": {}}

    cell = {"dtype": "bfloat16", "runs": [run(1.25, 1.0), run(1.0, 1.2)]}
    row = summarize(cell)["tok/s"]
    assert row["best_other"] == "dspark-k3" and row["ratio_in_sample"] == pytest.approx(0.9)
    assert row["ratio"] == pytest.approx(1.0) and row["verdict"].startswith("OK")


def test_matrix_waves_pool_per_concurrency():
    """A waves run of some concurrencies pools beside runs of others (its rows
    join theirs); --fresh drops only the rows of the concurrencies asked for;
    other settings, or another workload's, still decide as a whole, and the
    plan names the settings that differ."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_matrix import kept_runs, row_labels, unpooled

    def run(*cs):
        return {"rows": {f"c={c}": {} for c in cs}, "identity": {}}

    want = lambda *cs: {"arms": ["a"], "concurrency": list(cs)}  # noqa: E731
    cell = {"settings": want(4, 16, 64), "runs": [run(4, 16, 64)] * 3}
    assert kept_runs(cell, want(1), "waves", False) == (cell["runs"], 0)  # c=1 wants its runs; the rest stay
    assert kept_runs(cell, want(4), "waves", False)[1] == 3
    kept, have = kept_runs(cell, want(4, 16), "waves", True)
    assert have == 0 and [row_labels([r]) for r in kept] == [["c=64"]] * 3
    assert kept_runs(cell, {**want(4), "arms": ["b"]}, "waves", False) == ([], 0)
    # Said at planning: runs at other settings are replaced at every concurrency.
    assert unpooled(cell, {**want(4), "arms": ["b"]}, "waves") == ["arms"] and not unpooled(cell, want(4), "waves")
    assert unpooled(None, want(4), "waves") == [] and unpooled(cell, want(4), "soak") == ["concurrency"]
    assert row_labels([run(16, 4), run(1)]) == ["c=1", "c=4", "c=16"]
    soak = {"settings": {"x": 1}, "runs": [run(24)]}
    assert kept_runs(soak, {"x": 1}, "soak", False)[1] == 1 and kept_runs(soak, {"x": 1}, "soak", True) == ([], 0)


def test_matrix_skips_the_capped_bf16_regime_on_an_amx_cpu():
    """Its engines abort on the first step there (bench_matrix.regime_blocked);
    float32, and bf16 on a CPU without AMX, still run."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_matrix import regime_blocked

    amx, avx2 = ["avx512f", "amx_bf16", "amx_tile"], ["avx2"]
    assert regime_blocked("avx2cap", "bfloat16", amx)
    assert regime_blocked("avx2cap", "float32", amx) is None
    assert regime_blocked("native", "bfloat16", amx) is None
    assert regime_blocked("avx2cap", "bfloat16", ["avx512f"]) is None
    assert regime_blocked("native", "bfloat16", avx2) is None


def test_cold_start_add_pools_earlier_pairs_with_their_commit(tmp_path):
    """--add keeps --out's pairs per concurrency, each tagged with the commit
    it ran at (its own tag where it has one), and refuses a record of other
    settings (a pair run one engine after the other included) rather than
    mixing figures."""
    import json
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_cold_start import earlier_pairs

    out = tmp_path / "cold.json"
    args = SimpleNamespace(out=out, dtype="bfloat16", tokens=2000, max_tokens=128)
    assert earlier_pairs(args) == {}
    rows = [{"c": 16, "pairs": [{"ratio": 0.9}, {"ratio": 1.1, "commit": "old"}]}]
    record = {"dtype": "bfloat16", "tokens": 2000, "max_tokens": 128, "concurrency": rows}
    out.write_text(json.dumps({**record, "schedule": "interleaved"}))
    out.with_name("cold.provenance.json").write_text(json.dumps({"commit": "abc"}))
    assert earlier_pairs(args) == {16: [{"commit": "abc", "ratio": 0.9}, {"commit": "old", "ratio": 1.1}]}
    with pytest.raises(SystemExit, match="float32"):
        earlier_pairs(SimpleNamespace(**{**vars(args), "dtype": "float32"}))
    out.write_text(json.dumps(record))  # a record from before the engines took turns: one after the other
    with pytest.raises(SystemExit, match="sequential"):
        earlier_pairs(args)


def test_stray_engine_processes_are_found_and_this_runs_are_not(tmp_path):
    """An engine-titled process this run started is its own; one whose
    parent is gone (a grandchild left behind, as an engine core is when its
    client ends without shutting it down) is stray, and provenance counts it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from vllm_dspark import strays

    title = "open('/proc/self/comm', 'w').write('VLLM::TestCore'); import time; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", title])
    pid_file = tmp_path / "pid"
    orphaner = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {title!r}]); "
                f"open({str(pid_file)!r}, 'w').write(str(p.pid))")
    subprocess.run([sys.executable, "-c", orphaner], check=True)
    stray = int(pid_file.read_text())
    try:
        for _ in range(100):  # the titles are written once the interpreters start
            found = strays.stray_engines()
            if stray in found and Path(f"/proc/{child.pid}/comm").read_text().strip() == "VLLM::TestCore":
                break
            time.sleep(0.05)
        assert stray in found and child.pid not in found
        assert benchmarking.provenance([], engine=False)["stray_engine_processes"] >= 1
    finally:
        child.kill()
        child.wait()
        os.kill(stray, signal.SIGKILL)
