"""Where a drafting DSpark step spends its time, phase by phase: adaptive
(K=7, its blocks sized to its walk depth and, as before, K deep) against full
blocks (K=3, K=7), beside a step without speculation.

    python benchmarks/bench_drafting_phases.py                  # c = 1, 8 rounds, ~2 min
    python benchmarks/bench_drafting_phases.py --concurrency 4 --dtype float32

The engines run in this process, as in bench_step_phases.py (whose timers
this shares: wall clock and this thread's CPU time per step), awake, with
fresh cost caches; three waves each first, so adaptive has learned to
draft. Rounds alternate the engines; each phase reports its median round in
thread CPU µs per engine step. The controller's rows are what a policy's
decisions cost; the drafter's and the rejection sampler's are the
speculative work. Writes JSON and a PNG.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_step_phases import instrument, per_step, round_order  # noqa: E402

ARMS = {"nospec": None, "full K=3": (3, "full", {}), "adaptive K=7": (7, "adaptive", {}),
        "adaptive K=7, K-deep blocks": (7, "adaptive", {"depth_sized_block": False}), "full K=7": (7, "full", {})}
CONTROLLER = ("coasts", "begin_step", "plan", "choose", "observe", "end_step")


def _totals(llm) -> dict | None:
    """The controller's running depth and length histograms and accepted tokens (None: no DSpark)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    if not hasattr(runner, "dspark"):
        return None
    t = runner.dspark.telemetry.totals
    return {"depth_hist": list(t.depth_hist), "length_hist": list(t.length_hist), "accepted_tokens": t.accepted_tokens}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in record["arms"] if a != "nospec"]
    phases = [p for p in record["phases"] if p.startswith(("controller.", "drafter.", "rejection_sampler."))]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(phases) + 1.5))
    height = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        ax.barh([j + i * height for j in range(len(phases))], [record["phases"][p][arm] for p in phases],
                height=height, label=f"{arm}: {record['tokens_per_s'][arm]:.0f} tok/s")
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(phases))], phases, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("thread CPU µs per engine step (median round)")
    ax.set_title(f"{record['machine']['cpu']}, {record.get('dtype', 'bfloat16')}, c={record['concurrency']}: "
                 f"drafting phases; no-spec "
                 f"{record['tokens_per_s']['nospec']:.0f} tok/s", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per engine, alternating")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "drafting_phases.json")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and worker in this process
    import tempfile

    os.environ.setdefault("VLLM_DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark_cache_"))
    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, measure_offline, start_engine, write_record
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    c = args.concurrency
    prompts = [p["text"] for p in load_prompts()][: max(8, 2 * c)]
    t0 = time.time()
    engines = {}
    for name, arm in ARMS.items():
        spec = knobs = None
        if arm is not None:
            spec = {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": arm[0]}
            knobs = {"persist_cost_model": False, "policy": arm[1], **arm[2]}
        engines[name] = start_engine(str(REPO / TINY_TARGET), max(4, c), spec=spec, knobs=knobs,
                                     distributed_executor_backend="uni", dtype=args.dtype)
    accs = {name: instrument(llm, CONTROLLER, drafting=True) for name, llm in engines.items()}
    for llm in engines.values():
        for _ in range(3):  # adaptive learns to draft
            measure_offline(llm, prompts, c, args.max_tokens)
    per_round = {name: [] for name in engines}
    before = {name: _totals(llm) for name, llm in engines.items()}
    for i in range(args.rounds):
        for name in round_order(engines, i):
            accs[name].clear()
            sample = measure_offline(engines[name], prompts, c, args.max_tokens)
            row = {k: cpu for k, (_, cpu) in per_step(accs[name])[0].items()}
            row["tokens_per_s"] = sample.tokens_per_s
            per_round[name].append(row)
        print(f"[phases] round {i + 1}/{args.rounds}: "
              + ", ".join(f"{n} {per_round[n][-1]['tokens_per_s']:.0f} tok/s" for n in engines), flush=True)
    keys = sorted(set().union(*(set(r) for rows in per_round.values() for r in rows)) - {"tokens_per_s"})
    phases = {k: {n: statistics.median(r.get(k, 0.0) for r in rows) for n, rows in per_round.items()} for k in keys}
    for k, row in phases.items():
        print(f"[phases] {k:36s} " + "  ".join(f"{n} {v:8.1f}" for n, v in row.items()))
    drafting = {}
    for name, llm in engines.items():  # what each DSpark arm drafted over the timed rounds
        now = _totals(llm)
        if now is not None:
            d = {k: [a - b for a, b in zip(now[k], before[name][k])] if isinstance(now[k], list)
                 else now[k] - before[name][k] for k in now}
            d["accepted_per_drafting_step"] = d["accepted_tokens"] / max(1, sum(d["depth_hist"]))
            drafting[name] = d
            print(f"[phases] {name}: depth histogram {d['depth_hist']}, "
                  f"{d['accepted_per_drafting_step']:.2f} accepted per drafting step", flush=True)
    record = {"command": " ".join(["python", "benchmarks/bench_drafting_phases.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "dtype": args.dtype, "concurrency": c, "rounds": args.rounds,
              "max_tokens": args.max_tokens, "drafting": drafting,
              "arms": list(engines), "unit": "thread CPU us per engine step, median round",
              "tokens_per_s": {n: statistics.median(r["tokens_per_s"] for r in rows) for n, rows in per_round.items()},
              "controller_us": {n: sum(phases[f"controller.{m}"][n] for m in CONTROLLER if f"controller.{m}" in phases)
                                for n in engines},
              "phases": phases, "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "drafting_phases")
    return record


if __name__ == "__main__":
    main()
    os._exit(0)  # in-process engines: skip their teardown
