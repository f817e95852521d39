"""Record the simulator's reference traces from real vLLM runs of the tiny pair.

    python benchmarks/record_traces.py          # ~3 min on 2 CPU cores

For each concurrency it starts a DSpark engine with policy "full" (K = 7, so
acceptance is seen at every drafted position) and tracing on, runs held-out
prompts in waves of `c` greedy requests, and measures tokens/s the way the
benchmark does. The traces go to examples/traces/<name>/ and the measured
throughput to examples/traces/<name>/run.json, which the simulator's
validation compares its replay against. Two more engines are measured at a
few concurrencies, since a full-block trace has no decode-only steps: one
without speculation (the CPU curve's no-spec steps), and a DSpark engine that
always skips its drafter (an SLO no step can meet), whose own online plain
model gives the CPU curve's plain steps.

    python benchmarks/record_traces.py --plain-only   # only those two, into the existing run.json
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WARMUP_REQUESTS = 4
PROMPT_TOKENS = 48  # the held-out prompts' length (vllm_dspark.training.prompts)


def record(name: str, concurrency: int, prompts: list[str], max_tokens: int, target: str, drafter: str,
           out_root: Path, plain: dict) -> dict:
    from vllm_dspark.benchmarking import measure_offline, start_engine, stop_engine
    from vllm_dspark.fingerprint import machine_info

    out = out_root / name
    tmp = Path(tempfile.mkdtemp(prefix="dspark-trace-"))
    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": 7}
    llm = start_engine(target, concurrency, spec=spec, knobs={"policy": "full", "trace_dir": str(tmp)})
    try:
        measure_offline(llm, prompts[:WARMUP_REQUESTS], WARMUP_REQUESTS, 16)  # traced; validation skips it
        sample = measure_offline(llm, prompts, concurrency, max_tokens)
    finally:
        stop_engine(llm)  # the worker flushes its trace on exit
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in sorted(tmp.glob("*.jsonl")):
        shutil.copy(f, out / f"trace-c{concurrency}.jsonl")
    shutil.rmtree(tmp, ignore_errors=True)
    run = {"concurrency": concurrency, "max_tokens": max_tokens, "requests": len(prompts), "k": 7,
           "prompt_tokens": PROMPT_TOKENS, "warmup_requests": WARMUP_REQUESTS,
           "policy": "full", "measured": sample.as_dict(), **plain, "machine": machine_info()}
    (out / "run.json").write_text(json.dumps(run, indent=1))
    print(f"[trace] {name}: c={concurrency} {sample.tokens_per_s:.1f} tok/s -> {out}", flush=True)
    return run


def measure_plain(label: str, prompts: list[str], concurrencies: list[int], max_tokens: int, target: str,
                  drafter: str | None = None) -> dict:
    """Decode tokens/s per concurrency of an engine without speculation
    (``drafter`` None) or of a DSpark engine that always skips drafting, and
    its step as a curve (plain_curve)."""
    from vllm_dspark.benchmarking import measure_offline, start_engine, stop_engine

    spec = None if drafter is None else {"method": "dspark", "model": drafter, "num_speculative_tokens": 7}
    knobs = None if drafter is None else {"slo_tokens_per_s": 1e6, "persist_cost_model": False}
    llm = start_engine(target, max(concurrencies), spec=spec, knobs=knobs)
    measured = {}
    try:
        measure_offline(llm, prompts[:4], 4, 16)
        for c in concurrencies:
            sample = measure_offline(llm, prompts[: max(2 * c, 8)], c, max_tokens)
            measured[str(c)] = sample.as_dict()
            print(f"[trace] {label} c={c}: {sample.tokens_per_s:.1f} tok/s", flush=True)
    finally:
        stop_engine(llm)
    return {"measured": measured, "curve": plain_curve(measured)}


def plain_curve(measured: dict) -> dict:
    """A linear fit T(R) = t0 + t_req R of the measured decode step times
    (one token per request per step; the engine's own online model would
    extrapolate its recent batch size to the others)."""
    import numpy as np

    concurrencies = sorted(int(c) for c in measured)
    cs = np.array(concurrencies, float)
    step_s = np.array([c / measured[str(c)]["tokens_per_s"] for c in concurrencies])
    t_req, t0 = np.polyfit(cs, step_s, 1)
    return {"t0": max(float(t0), 1e-6), "t_req": max(float(t_req), 0.0), "t_tok": 0.0}


def main(argv=None) -> None:
    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET
    from vllm_dspark.training.prompts import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--prompts", type=int, default=96, help="held-out prompts per run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "examples" / "traces")
    ap.add_argument("--plain-only", action="store_true",
                    help="measure only the no-spec and always-skipping engines, into the existing run.json files")
    args = ap.parse_args(argv)
    # Prompts past the first 64, which the benchmark uses.
    prompts = [p["text"] for p in load_prompts()][64 : 64 + args.prompts]
    cs = sorted({1, 4, 16, 64, *args.concurrency})
    target, drafter = str(REPO / TINY_TARGET), str(REPO / TINY_DRAFTER)
    plain = {"nospec": measure_plain("nospec", prompts, cs, args.max_tokens, target),
             "skip": measure_plain("dspark, drafter skipped", prompts, cs, args.max_tokens, target, drafter)}
    if args.plain_only:
        for c in args.concurrency:
            run_file = args.out / f"tiny-k7-full-c{c}" / "run.json"
            run = json.loads(run_file.read_text())
            run.update(plain)
            run_file.write_text(json.dumps(run, indent=1))
            print(f"[trace] updated {run_file}", flush=True)
        return
    for c in args.concurrency:
        record(f"tiny-k7-full-c{c}", c, prompts, args.max_tokens, str(REPO / TINY_TARGET),
               str(REPO / TINY_DRAFTER), args.out, plain)


if __name__ == "__main__":
    main()
