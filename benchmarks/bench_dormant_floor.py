"""What a DSpark engine that never drafts costs against no speculation.

    python benchmarks/bench_dormant_floor.py                 # c = 16 and 64, 40 pairs each, ~6 min
    python benchmarks/bench_dormant_floor.py --concurrency 16 --pairs 20

Under sustained load the adaptive controller goes dormant and drafts almost
nothing, so no-spec is the arm it is measured against, and what it can reach
there is bounded by this floor: the same engine, held dormant from the start
(every step runs as a step without speculation and the skip rule still runs,
but no step drafts). Head to head against no-spec, as in
bench_dspark.py. Writes JSON (machine, versions, every pair) and a PNG.

Holding the engine dormant patches its worker through collective_rpc with a
function, which vLLM only accepts with VLLM_ALLOW_INSECURE_SERIALIZATION=1;
this script sets it for its own engines.
"""

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def hold_dormant(worker) -> bool:
    """Runs in the worker: the controller is dormant from now on, whatever its
    rule finds (which still runs, with its bookkeeping and admissions); its
    steps run without speculation and no request keeps context, so none drafts."""
    from vllm_dspark.controller.dormancy import Dormancy

    class Held(Dormancy):
        def wake(self):  # neither the models nor the exploration budget end it
            pass

    ctl = worker.model_runner.dspark
    ctl.dormancy = Held(ctl.tuning, ctl.knobs.dormant_after_steps, ctl.dormancy.budget)
    ctl.dormancy.dormant = True
    return True


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench_dspark import plot_pairs

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(1.0, color="grey", linewidth=1)
    plot_pairs(ax, [(f"c={row['c']}", row) for row in record["concurrency"]],
               "DSpark engine held dormant / no-spec, per pair (bar: median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "dormant_floor.json")
    args = ap.parse_args(argv)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import tempfile

    os.environ.setdefault("VLLM_DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark_cache_"))
    from bench_dspark import pair_summary

    from vllm_dspark.benchmarking import (TINY_DRAFTER, TINY_TARGET, measure_head_to_head, measure_offline,
                                          start_engine, stop_engine, write_record)
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()]
    top = max(args.concurrency)
    spec = {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7}
    t0 = time.time()
    nospec = start_engine(str(REPO / TINY_TARGET), top)
    held = start_engine(str(REPO / TINY_TARGET), top, spec=spec, knobs={"persist_cost_model": False})
    rows = []
    try:
        held.collective_rpc(hold_dormant)
        for llm in (nospec, held):
            measure_offline(llm, prompts[:4], 4, 16)  # warm-up
        for c in args.concurrency:
            rates = measure_head_to_head(held, nospec, prompts, c, args.max_tokens, args.pairs)
            row = {"c": c, **pair_summary(rates)}
            rows.append(row)
            print(f"[floor] c={c}: held dormant / no-spec = {row['median']:.3f} (median of {args.pairs} "
                  f"pairs; 90% interval {row['interval90'][0]:.2f}-{row['interval90'][1]:.2f})", flush=True)
        snap = held.collective_rpc("dspark_snapshot")[0]
    finally:
        for llm in (nospec, held):
            stop_engine(llm)
    record = {"command": " ".join(["python", "benchmarks/bench_dormant_floor.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "max_tokens": args.max_tokens, "concurrency": rows,
              "held_engine": {k: snap[k] for k in ("steps", "skipped_steps", "contextless_requests")},
              "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "floor")
    return record


if __name__ == "__main__":
    main()
