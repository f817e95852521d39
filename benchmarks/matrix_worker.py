"""One run of one cell of bench_matrix.py, in its own process (the regime's environment is set).

    python benchmarks/matrix_worker.py JOB_JSON OUT_JSON

JOB_JSON is written by bench_matrix.py (workload, dtype, arms, settings, run index); the result
(every row's rounds, integrity counts, greedy identity against nospec, provenance) goes to
OUT_JSON. Progress lines start with ``[matrix]`` / ``[bench]``; vLLM's own logs go alongside.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

AD, K7, NS = "dspark-adaptive", "dspark-k7", "nospec"
SOAK_C, SOAK_MODEL_LEN = 24, 256


def rotate(names: list, r: int) -> list:
    return names[r % len(names):] + names[: r % len(names)]


def arm_spec(name: str, drafter: str):
    from bench_dspark import ARMS as SPECS

    arm = SPECS[name]
    return (None, None) if arm is None else (
        {"method": "dspark", "model": drafter, "num_speculative_tokens": arm["k"]}, arm["knobs"])


def start_offline(name: str, job: dict, max_num_seqs: int, need: int = 0, **kw):
    from vllm_dspark.benchmarking import kv_capacity_tokens, start_engine

    os.environ["VLLM_DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark_cache_")  # cold start
    print(f"[matrix] starting {name}", flush=True)
    spec, knobs = arm_spec(name, job["drafter"])
    llm = start_engine(job["target"], max_num_seqs, spec=spec, knobs=knobs, dtype=job["dtype"], **kw)
    if kv_capacity_tokens(llm) < need:
        raise RuntimeError(f"{name}: KV cache holds {kv_capacity_tokens(llm)} tokens, the waves need {need}")
    return llm


def greedy_ids(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def identity(outs: dict, lengths: dict) -> dict:
    """Per arm: its sample's outputs equal to nospec's (token ids or text), and lengths right."""
    ref, out = outs.get(NS), {}
    for a, o in outs.items():
        compare = ref is not None and a != NS
        out[a] = {"identical": sum(x == y for x, y in zip(o, ref)) if compare else None,
                  "compared": len(o) if compare else 0, "lengths_ok": lengths[a]}
    return out


def run_waves(job: dict, prompts: list[str]) -> tuple[dict, dict]:
    from bench_dspark import LOOKAHEAD, PROMPT_TOKENS, run_head_to_head

    from vllm_dspark.benchmarking import measure_interleaved, stop_engine

    cs, mt, engines = job["concurrency"], job["max_tokens"], {}
    try:
        for name in rotate(job["arms"], job["run"]):  # started in turn: no arm is always the last process
            engines[name] = start_offline(name, job, max(cs), max(cs) * (PROMPT_TOKENS + mt + LOOKAHEAD))
        arms = measure_interleaved(engines, prompts, cs, mt, job["rounds"])
        duels = (run_head_to_head(engines, arms, prompts, mt, job["pairs"])
                 if job["pairs"] and AD in engines and len(engines) > 1 else {})
        outs = {n: greedy_ids(llm, prompts[: job["identity"]], mt) for n, llm in engines.items()}
    finally:
        for llm in engines.values():
            stop_engine(llm)
    rows = {}
    for i, c in enumerate(cs):
        per = {n: arms[n][i] for n in arms}
        rows[f"c={c}"] = {
            "rounds": [dict(zip(per, vals)) for vals in zip(*(r["rounds_tokens_per_s"] for r in per.values()))],
            "pairs": [a / b for a, b in duels[c]["pairs"]] if c in duels else None,
            "against": duels.get(c, {}).get("against"),
            "integrity": {n: {"requests": r["requests"], "tokens": r["output_tokens"],
                              "expected_tokens": r["requests"] * mt, "ok": r["output_tokens"] == r["requests"] * mt}
                          for n, r in per.items()},
            "detail": {n: {k: r.get(k) for k in ("tokens_per_s", "mean_accepted_length", "controller")}
                       for n, r in per.items()}}
    return rows, identity(outs, {n: all(len(o) == mt for o in v) for n, v in outs.items()})


def start_server(name: str, job: dict, work: Path) -> tuple:
    from vllm_dspark.benchmarking import ENGINE_DEFAULTS, KV_CACHE_BYTES
    from vllm_dspark.benchmarking import start_server as serve

    spec, knobs = arm_spec(name, job["drafter"])
    args = ["--dtype", job["dtype"], "--max-model-len", str(ENGINE_DEFAULTS["max_model_len"]),
            "--max-num-seqs", str(max(job["concurrency"])), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--enforce-eager", "--seed", "0"]
    if spec:
        args += ["--speculative-config", json.dumps(spec), "--additional-config", json.dumps({"dspark": knobs})]
    env = {**os.environ, "VLLM_DSPARK_CACHE_DIR": tempfile.mkdtemp(prefix="dspark_cache_")}
    print(f"[matrix] starting vllm serve {name}", flush=True)
    proc, base, log = serve(job["target"], args, work / f"{name}.server.log", env)
    return proc, int(base.rsplit(":", 1)[1]), log


def bench_client(port: int, job: dict, data: Path, n: int, out: Path) -> dict:
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", job["target"], "--tokenizer", job["target"], "--dataset-name", "sharegpt",
           "--dataset-path", str(data), "--disable-shuffle", "--sharegpt-output-len", str(job["serve_tokens"]),
           "--num-prompts", str(n), "--request-rate", str(job["rate"]), "--seed", "0", "--ignore-eos",
           "--temperature", "0", "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(out.parent), "--result-filename", out.name,
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())


def controller_totals(port: int) -> dict:
    """A DSpark server's controller totals from its /metrics (vllm_dspark:*, metrics.py)."""
    from vllm_dspark.benchmarking import server_metric

    base = f"http://127.0.0.1:{port}"
    names = {"drafting_steps": "vllm_dspark:draft_depth_count", "plain_steps": "vllm_dspark:plain_steps_total",
             "contextless_requests": "vllm_dspark:contextless_requests_total"}
    return {key: server_metric(base, metric) for key, metric in names.items()}


def run_serve(job: dict, prompts: list[str]) -> tuple[dict, dict]:
    heavy, tokens = job["workload"] == "poisson-heavy", job["serve_tokens"]
    n, work = job["serve_prompts"][heavy], Path(tempfile.mkdtemp(prefix="dspark_matrix_serve_"))
    data = work / "heldout_sharegpt.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "-"}]}
                                for p in prompts[:n]]))
    servers, rounds, integ, texts, detail = {}, [], {}, {}, {}
    try:
        for name in rotate(job["arms"], job["run"]):
            servers[name] = start_server(name, job, work)
        for r in range(job["serve_rounds"]):
            got = {}
            for name in rotate(job["arms"], r + job["run"]):
                res = bench_client(servers[name][1], job, data, n, work / f"{name}_{r}.json")
                got[name] = res["output_throughput"] if heavy else 1000 / res["median_tpot_ms"]
                i = integ.setdefault(name, {"completed": 0, "failed": 0, "expected": 0, "tokens": 0,
                                            "expected_tokens": 0, "lengths_ok": True})
                i["completed"] += res["completed"]
                i["failed"] += res["failed"]
                i["expected"] += n
                i["tokens"] += res["total_output_tokens"]
                i["expected_tokens"] += n * tokens
                lens = res.get("output_lens") or []
                i["lengths_ok"] &= len(lens) == n and all(x == tokens for x in lens)
                texts.setdefault(name, res["generated_texts"][: job["identity"]])
                detail.setdefault(name, []).append({k: res.get(k) for k in (
                    "duration", "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms",
                    "median_ttft_ms", "mean_itl_ms", "max_concurrent_requests")})
                if name != NS:  # what the controller did, so far (its metrics are cumulative)
                    detail[name][-1]["controller"] = controller_totals(servers[name][1])
                print(f"[matrix] {job['workload']} round {r + 1} {name}: {res['output_throughput']:.0f} tok/s, "
                      f"median TPOT {res['median_tpot_ms']:.2f} ms, {res['completed']}/{n} done", flush=True)
            rounds.append(got)
    finally:
        from vllm_dspark.benchmarking import stop_server

        for server in servers.values():
            stop_server(server)
    for i in integ.values():
        i["ok"] = i["completed"] == i["expected"] and not i["failed"] and i["tokens"] == i["expected_tokens"]
    row = {"rounds": rounds, "integrity": integ, "detail": detail, "rate_req_s": job["rate"], "prompts": n}
    return {"out tok/s" if heavy else "1000/median TPOT": row}, identity(texts, {a: integ[a]["lengths_ok"] for a in texts})


def preemptions(outs) -> int | None:
    """Preemptions of these requests, from their own stats (vllm:num_preemptions would not do: every
    engine start unregisters the process's earlier engines' Prometheus metrics)."""
    stats = [getattr(o.metrics, "num_preemptions", None) for o in outs]
    return None if None in stats else sum(stats)


def soak_kv_bytes(job: dict, arm: str = NS) -> int:
    """--soak-kv-tokens of the target's KV in bytes; for a DSpark arm of soak-tokens, the bytes that
    hold as many tokens next to its drafter's KV (what the start-up log advises)."""
    from types import SimpleNamespace

    from vllm_dspark.layouts import kv_share

    cfg = [json.loads((Path(job[m]) / "config.json").read_text()) for m in ("target", "drafter")]
    per_token = 2 * cfg[0]["num_hidden_layers"] * cfg[0]["num_key_value_heads"] * cfg[0]["head_dim"]
    target = job["soak_kv_tokens"] * per_token * (4 if job["dtype"] == "float32" else 2)
    if job["workload"] != "soak-tokens" or arm == NS:
        return target
    return round(target / (1 - kv_share(*(SimpleNamespace(**c) for c in reversed(cfg)))))


def run_soak(job: dict, prompts: list[str]) -> tuple[dict, dict]:
    from vllm import SamplingParams

    from vllm_dspark.benchmarking import kv_capacity_tokens, stop_engine

    mt, n = job["max_tokens"], job["soak_requests"]
    lens = [max(1, mt // 4), max(1, mt // 2), mt]
    params = [SamplingParams(max_tokens=lens[i % 3], ignore_eos=True,
                             **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 1000 + i}))
              for i in range(n)]
    engines, rounds, integ, detail, outs = {}, [], {}, {}, {}
    try:
        for name in rotate(job["arms"], job["run"]):
            engines[name] = start_offline(name, job, SOAK_C, kv_cache_memory_bytes=soak_kv_bytes(job, name),
                                          max_model_len=SOAK_MODEL_LEN)
            engines[name].generate(prompts[:4], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        for r in range(job["soak_rounds"]):
            got = {}
            for name in rotate(job["arms"], r + job["run"]):
                llm, t0 = engines[name], time.perf_counter()
                res = llm.generate(prompts[:n], params, use_tqdm=False)
                wall = time.perf_counter() - t0
                got_lens = [len(o.outputs[0].token_ids) for o in res]
                got[name] = sum(got_lens) / wall
                ok = len(res) == n and all(o.finished for o in res) and got_lens == [p.max_tokens for p in params]
                i = integ.setdefault(name, {"completed": 0, "expected": 0, "tokens": 0, "ok": True})
                i["completed"] += sum(o.finished for o in res)
                i["expected"] += n
                i["tokens"] += sum(got_lens)
                i["ok"] &= ok
                outs.setdefault(name, [list(o.outputs[0].token_ids) for o in res[::2][: job["identity"]]])
                detail.setdefault(name, []).append({"wall_s": wall, "tokens_per_s": got[name],
                                                    "preemptions": preemptions(res),
                                                    "kv_capacity_tokens": kv_capacity_tokens(llm)})
                if name != NS:  # what the controller did, so far (its totals are cumulative)
                    detail[name][-1]["controller"] = llm.collective_rpc("dspark_snapshot")[0]
                print(f"[matrix] soak round {r + 1} {name}: {got[name]:.0f} tok/s, {wall:.1f} s, "
                      f"{detail[name][-1]['preemptions']} preemptions, lengths {'ok' if ok else 'WRONG'}",
                      flush=True)
            rounds.append(got)
    finally:
        for llm in engines.values():
            stop_engine(llm)
    row = {"rounds": rounds, "integrity": integ, "detail": detail, "output_lengths": lens,
           "kv_cache_memory_bytes": {name: soak_kv_bytes(job, name) for name in job["arms"]}}
    return {f"c={SOAK_C}": row}, identity(outs, {a: integ[a]["ok"] for a in outs})


def worker(job_path: str, out_path: str) -> dict:
    """One run of one cell, in this process (the regime's environment is already set)."""
    from vllm_dspark.benchmarking import ENGINE_DEFAULTS, provenance
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    job, t0 = json.loads(Path(job_path).read_text()), time.time()
    prompts = [p["text"] for p in load_prompts()]
    fn = {"waves": run_waves, "soak": run_soak, "soak-tokens": run_soak}.get(job["workload"], run_serve)
    rows, ident = fn(job, prompts)
    os.environ.pop("VLLM_DSPARK_CACHE_DIR", None)
    prov = {**provenance(job["argv"]), "machine": machine_info()}
    prov["engine_defaults"] = {**ENGINE_DEFAULTS, "dtype": job["dtype"]}
    result = {"rows": rows, "identity": ident, "provenance": prov, "wall_s": round(time.time() - t0, 1)}
    Path(out_path).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
