"""Where a dormant DSpark step spends its time, phase by phase, against a step
without speculation.

    python benchmarks/bench_step_phases.py                 # c = 16, 12 rounds, ~1 min
    python benchmarks/bench_step_phases.py --concurrency 64 --rounds 8

Both engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
"uni" executor), the DSpark one held dormant from the start as in
bench_dormant_floor.py. Each timed method (vLLM's scheduler, KV cache manager
and runner phases, and the controller's step hooks) is wrapped on the
instance with a timer: wall clock and this thread's CPU time, per step. The
rounds alternate between the engines; each phase reports its median round,
and the difference is the median of the per-round differences. Thread CPU
time is what a busy neighbour does not inflate, so a difference of a few µs
a step stands out of the machine's noise, where a throughput ratio needs
dozens of pairs. Writes JSON and a PNG.

The whole-step and forward rows also carry the engines' own difference: two
engines with the same weights have differed in forward time by up to 3% (in
either direction) in one process. The phases outside the forward are the
DSpark engine's overhead.
"""

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

RUNNER = ("execute_model", "sample_tokens", "_update_states", "_prepare_inputs", "_build_attention_metadata",
          "_model_forward", "_sample", "_bookkeeping_sync")
CONTROLLER = ("coasts", "begin_step", "plan", "end_step")
SCHEDULER = ("schedule", "update_from_output")
DRAFTER = ("propose", "_sample_block", "flush_context")


def _timed(obj, name: str, acc: dict, tag: str) -> None:
    """Wrap ``obj.name`` (an instance attribute shadowing the method) with a timer."""
    fn = getattr(obj, name, None)
    if fn is None:
        return

    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            row = acc[f"{tag}.{name}"]
            row[0] += time.perf_counter() - wall
            row[1] += time.thread_time() - cpu
            row[2] += 1

    setattr(obj, name, timed)


def instrument(llm, controller: tuple[str, ...] = CONTROLLER, drafting: bool = False) -> dict:
    """Time vLLM's step phases and the ``controller`` hooks of an in-process
    engine; with ``drafting``, the drafting path too (bench_drafting_phases.py)."""
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    acc = defaultdict(lambda: [0.0, 0.0, 0])  # wall s, CPU s, calls
    for name in RUNNER + (("propose_draft_token_ids",) if drafting else ()):
        _timed(runner, name, acc, "runner")
    for name in SCHEDULER:
        _timed(core.scheduler, name, acc, "scheduler")
    _timed(core.scheduler.kv_cache_manager, "allocate_slots", acc, "kv_cache_manager")
    _timed(core, "step_fn", acc, "engine_core")
    if hasattr(runner, "dspark"):
        for name in controller:
            _timed(runner.dspark, name, acc, "controller")
        if drafting:
            for name in DRAFTER:
                _timed(runner.drafter, name, acc, "drafter")
            _timed(runner.rejection_sampler, "forward", acc, "rejection_sampler")
    return acc


def round_order(names, i: int) -> list[str]:
    """Round ``i``'s order: reversed every other round, so drift favours no engine."""
    return list(names) if i % 2 == 0 else list(names)[::-1]


def per_step(acc: dict) -> tuple[dict, int]:
    """Each timed phase as (wall, CPU) µs per engine step, and the steps."""
    steps = max(1, acc["scheduler.schedule"][2])
    return {k: (v[0] / steps * 1e6, v[1] / steps * 1e6) for k, v in acc.items()}, steps


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["phases"] if r["phase"] != "step (wall)"]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.5))
    ax.barh([r["phase"] for r in rows], [r["cpu_us_diff"] for r in rows], color="tab:blue")
    ax.axvline(0, color="grey", linewidth=1)
    ax.invert_yaxis()
    ax.set_xlabel("DSpark held dormant minus no-spec, thread CPU µs per step (median of rounds)")
    ax.set_title(f"c={record['concurrency']}: whole step {record['step_cpu_us_diff']:+.0f} µs against "
                 f"{record['nospec_step_cpu_us']:.0f} µs without speculation (nested phases overlap)", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=12, help="rounds per engine, alternating")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "step_phases.json")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and worker in this process
    import tempfile

    os.environ.setdefault("VLLM_DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark_cache_"))
    from bench_dormant_floor import hold_dormant

    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, measure_offline, start_engine, write_record
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()][: 2 * args.concurrency]
    spec = {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7}
    t0 = time.time()
    engines = {
        "nospec": start_engine(str(REPO / TINY_TARGET), args.concurrency, distributed_executor_backend="uni"),
        "dormant": start_engine(str(REPO / TINY_TARGET), args.concurrency, spec=spec,
                                knobs={"persist_cost_model": False}, distributed_executor_backend="uni"),
    }
    hold_dormant(engines["dormant"].llm_engine.engine_core.engine_core.model_executor.driver_worker.worker)
    accs = {name: instrument(llm) for name, llm in engines.items()}
    for llm in engines.values():
        measure_offline(llm, prompts, args.concurrency, args.max_tokens)  # warm-up
    per_round = {name: [] for name in engines}
    for i in range(args.rounds):
        for name in round_order(engines, i):
            accs[name].clear()
            wall, cpu = time.perf_counter(), time.thread_time()
            measure_offline(engines[name], prompts, args.concurrency, args.max_tokens)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            row, steps = per_step(accs[name])
            row["step (wall)"] = (wall / steps * 1e6, cpu / steps * 1e6)
            per_round[name].append(row)
        print(f"[phases] round {i + 1}/{args.rounds}: "
              + ", ".join(f"{n} {per_round[n][-1]['step (wall)'][0]:.0f} µs/step" for n in engines), flush=True)
    phases = []
    for phase in sorted(set(per_round["nospec"][0]) | set(per_round["dormant"][0])):
        def median(name, j):
            values = [r[phase][j] for r in per_round[name] if phase in r]
            return statistics.median(values) if values else 0.0

        diffs = [(d.get(phase, (0.0, 0.0)), n.get(phase, (0.0, 0.0)))
                 for n, d in zip(per_round["nospec"], per_round["dormant"])]
        phases.append({"phase": phase, "nospec_wall_us": median("nospec", 0), "dormant_wall_us": median("dormant", 0),
                       "nospec_cpu_us": median("nospec", 1), "dormant_cpu_us": median("dormant", 1),
                       "wall_us_diff": statistics.median(d[0] - n[0] for d, n in diffs),
                       "cpu_us_diff": statistics.median(d[1] - n[1] for d, n in diffs)})
    for p in phases:
        print(f"[phases] {p['phase']:40s} no-spec {p['nospec_cpu_us']:8.1f}  dormant {p['dormant_cpu_us']:8.1f}  "
              f"diff {p['cpu_us_diff']:+7.1f} µs CPU/step")
    step = next(p for p in phases if p["phase"] == "step (wall)")
    record = {"command": " ".join(["python", "benchmarks/bench_step_phases.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "concurrency": args.concurrency, "rounds": args.rounds,
              "max_tokens": args.max_tokens,
              "nospec_step_cpu_us": step["nospec_cpu_us"], "step_cpu_us_diff": step["cpu_us_diff"],
              "phases": phases, "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "phases")
    return record


if __name__ == "__main__":
    main()
    os._exit(0)  # in-process engines: skip their teardown
