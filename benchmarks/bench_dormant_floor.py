"""What a DSpark engine that never drafts costs against no speculation.

    python benchmarks/bench_dormant_floor.py                 # c = 16 and 64, 40 pairs each, ~6 min
    python benchmarks/bench_dormant_floor.py --concurrency 16 --pairs 20
    python benchmarks/bench_dormant_floor.py --in-engine     # the hooks' own cost, c = 1, 4, 16, 64, ~4 min
    python benchmarks/bench_dormant_floor.py --awake         # the awake path's cost, c = 1 and 4, ~6 min

Under sustained load the adaptive controller goes dormant and drafts almost
nothing, so no-spec is the arm it is measured against, and what it can reach
there is bounded by this floor: the same engine, held dormant from the start
(every step runs as a step without speculation and the skip rule still runs,
but no step drafts). Head to head against no-spec, as in
bench_dspark.py. Writes JSON (machine, versions, every pair) and a PNG.

``--in-engine`` measures what the floor is made of without two processes'
noise: one held engine alternates steps between DSpark's runner and vLLM's
own runner methods called directly (the plain step the dormant one mirrors),
and the worker times each step (execute_model + sample_tokens): the
difference of the means, per round of waves, is what DSpark's hooks cost a
dormant step (a mean: the rule's steps and the pace canary run on one step
in several, and throughput pays them; a median leaves them out, and is kept
beside it). Writes dormant_hooks.json and its PNG.

``--awake`` measures what a step without drafts costs an awake engine
(the target's aux hidden states for the drafter's context, the speculative
metadata, the rule, the drafter's context queued): the path an episode's
explore and price steps take (gate.py), and every drafting step's floor.
One engine, held dormant and held awake skipping the drafter on every step
by turns, a round of waves each, ABBA: awake / dormant per pair; a no-spec
engine runs a round in each pair too (first or last, by turns), the
baseline both are read against. Writes awake_path.json and its PNG.

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
    steps run without speculation and no request keeps context, so none drafts.
    The controller's own Dormancy, patched (its parts hold it: a new one
    would leave coasting asking the old)."""
    dormancy = worker.model_runner.dspark.dormancy
    dormancy.wake = lambda: None  # neither the models nor the exploration budget end it
    dormancy.sleep()
    return True


def hold(worker, mode: str) -> bool:
    """Runs in the worker: hold the controller dormant (as hold_dormant) or,
    ``mode`` "awake", awake with the drafter skipped on every step (its
    requests admitted with context, as in an episode), until the next call."""
    from vllm_dspark.controller.plan import StepPlan

    ctl = worker.model_runner.dspark
    dormancy = ctl.dormancy
    for name in ("wake", "sleep", "plan"):  # undo the last hold
        vars(dormancy).pop(name, None)
        vars(ctl).pop(name, None)
    if mode == "dormant":
        return hold_dormant(worker)
    dormancy.wake()
    dormancy.sleep = lambda: None

    def skip_every_step(requests):
        ctl._admit(requests)
        ctl._skip()
        return StepPlan("skip", ctl.depth, ctl.ledger.among(requests.req_ids))

    ctl.plan = skip_every_step
    return True


def _held_engine(args):
    """The DSpark engine (K=7, defaults, no persisted costs) the in-engine measurements hold."""
    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, start_engine

    spec = {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7}
    return start_engine(str(REPO / TINY_TARGET), max(args.concurrency), spec=spec, knobs={"persist_cost_model": False})


def awake_path(args, prompts: list[str]) -> list[dict]:
    from bench_dspark import pair_summary

    from vllm_dspark.benchmarking import TINY_TARGET, measure_offline, start_engine, stop_engine

    nospec = start_engine(str(REPO / TINY_TARGET), max(args.concurrency))
    held, rows = _held_engine(args), []
    try:
        measure_offline(nospec, prompts[:4], 4, 16)  # warm-up
        for mode in ("awake", "dormant"):
            held.collective_rpc(hold, args=(mode,))
            measure_offline(held, prompts[:4], 4, 16)
        for c in args.concurrency:
            n = c * max(2, 4 // c)
            rates, kinds = [], {mode: {"plain_steps": 0, "skipped_steps": 0, "verified_blocks": 0}
                                for mode in ("awake", "dormant")}
            for i in range(args.pairs):
                modes = ("awake", "dormant") if i % 2 == 0 else ("dormant", "awake")
                tps = {}
                for mode in ("nospec", *modes) if i % 4 < 2 else (*modes, "nospec"):
                    if mode == "nospec":
                        tps[mode] = measure_offline(nospec, prompts[:n], c, args.max_tokens).tokens_per_s
                        continue
                    held.collective_rpc(hold, args=(mode,))
                    before = held.collective_rpc("dspark_snapshot")[0]
                    tps[mode] = measure_offline(held, prompts[:n], c, args.max_tokens).tokens_per_s
                    after = held.collective_rpc("dspark_snapshot")[0]
                    for key in kinds[mode]:  # integrity: awake rounds skip, dormant ones run plain, none drafts
                        kinds[mode][key] += after[key] - before[key]
                rates.append((tps["awake"], tps["dormant"], tps["nospec"]))
            row = {"c": c, **pair_summary([(a, d) for a, d, _ in rates]), "steps": kinds,
                   "nospec_tok_s": [r[2] for r in rates],
                   "awake_vs_nospec": pair_summary([(a, s) for a, _, s in rates]),
                   "dormant_vs_nospec": pair_summary([(d, s) for _, d, s in rates])}
            rows.append(row)
            print(f"[floor] c={c}: held awake / held dormant = {row['median']:.3f} (median of {args.pairs} "
                  f"pairs; 90% interval {row['interval90'][0]:.2f}-{row['interval90'][1]:.2f}); against no-spec "
                  f"awake {row['awake_vs_nospec']['median']:.3f}, dormant {row['dormant_vs_nospec']['median']:.3f}; "
                  f"steps {kinds}", flush=True)
    finally:
        for llm in (nospec, held):
            stop_engine(llm)
    return rows


def time_steps(worker) -> bool:
    """Runs in the worker: steps alternate between DSpark's runner methods
    ("dspark") and vLLM's CPU runner's, called directly ("vllm"), both on the
    plain step, and each is timed (execute_model and sample_tokens, not the
    engine's gap between the two calls). Alternating step by step, the
    machine's drift (here ±20% between waves) falls on both alike. Decode
    steps only: a wave's prompt steps fall on one arm or the other by the
    step's parity, and would outweigh the hooks in a mean."""
    import time

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    runner = worker.model_runner
    arms = {"dspark": type(runner), "vllm": CPUModelRunner}
    state = worker.dspark_ab = {"arm": "vllm", "steps": {"dspark": [], "vllm": []}, "execute": 0.0}
    runner._plain_switch.set(True)

    def execute_model(scheduler_output, *args, **kwargs):
        state["arm"] = "dspark" if state["arm"] == "vllm" else "vllm"
        state["decode"] = scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens)
        args = (scheduler_output, *args)
        t0 = time.perf_counter()
        out = arms[state["arm"]].execute_model(runner, *args, **kwargs)
        state["execute"] = time.perf_counter() - t0
        return out

    def sample_tokens(*args, **kwargs):
        t0 = time.perf_counter()
        out = arms[state["arm"]].sample_tokens(runner, *args, **kwargs)
        if state["decode"]:
            state["steps"][state["arm"]].append(state["execute"] + time.perf_counter() - t0)
        return out

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    return True


def take_steps(worker) -> dict:
    steps = worker.dspark_ab["steps"]
    worker.dspark_ab["steps"] = {"dspark": [], "vllm": []}
    return steps


def in_engine(args, prompts: list[str]) -> list[dict]:
    import statistics

    from bench_dspark import bootstrap_median_interval

    from vllm_dspark.benchmarking import measure_offline, stop_engine

    held, rows = _held_engine(args), []
    try:
        held.collective_rpc(hold_dormant)
        measure_offline(held, prompts[:4], 4, 16)  # warm-up
        held.collective_rpc(time_steps)
        for c in args.concurrency:
            diffs, means, medians = [], [], []
            for _ in range(args.pairs):
                measure_offline(held, prompts[: c * max(2, 4 // c)], c, args.max_tokens)
                steps = held.collective_rpc(take_steps)[0]
                means.append({arm: statistics.mean(v) * 1e6 for arm, v in steps.items()})
                medians.append({arm: statistics.median(v) * 1e6 for arm, v in steps.items()})
                diffs.append(means[-1]["dspark"] - means[-1]["vllm"])
            base = statistics.median(m["vllm"] for m in means)
            row = {"c": c, "vllm_step_us": base, "step_us_per_round": means, "hooks_us_per_round": diffs,
                   "hooks_us_median": statistics.median(diffs), "hooks_us_interval90": bootstrap_median_interval(diffs),
                   "median_step_us_per_round": medians,
                   "hooks_us_of_medians": statistics.median(m["dspark"] - m["vllm"] for m in medians)}
            row["share_of_step"] = row["hooks_us_median"] / base
            rows.append(row)
            lo, hi = row["hooks_us_interval90"]
            print(f"[floor] c={c}: a dormant step {row['hooks_us_median']:.0f} us over vLLM's plain step "
                  f"({100 * row['share_of_step']:.1f}% of its {base:.0f} us; median of {args.pairs} rounds' "
                  f"mean steps, 90% interval {lo:.0f} to {hi:.0f} us; of their median steps "
                  f"{row['hooks_us_of_medians']:.0f} us)", flush=True)
    finally:
        stop_engine(held)
    return rows


def plot_hooks(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["concurrency"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, row in enumerate(rows):
        ax.scatter([i] * len(row["hooks_us_per_round"]), row["hooks_us_per_round"], s=10, alpha=0.5)
        ax.plot([i - 0.3, i + 0.3], [row["hooks_us_median"]] * 2, color="black")
    ax.axhline(0.0, color="grey", linewidth=1)
    ax.set_xticks(range(len(rows)), [f"c={r['c']}\n({r['vllm_step_us'] / 1e3:.1f} ms step)" for r in rows])
    ax.set_ylabel("us per step over vLLM's plain step")
    ax.set_title("DSpark's hooks on a dormant step, one engine (per round's mean step; bar: median)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench_dspark import plot_pairs

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(1.0, color="grey", linewidth=1)
    what = "held awake skipping the drafter / held dormant" if record.get("awake") else "held dormant / no-spec"
    plot_pairs(ax, [(f"c={row['c']}", row) for row in record["concurrency"]],
               f"DSpark engine {what}, per pair (bar: median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", help="default: 16 64 (--in-engine: 1 4 16 64)")
    ap.add_argument("--pairs", type=int, help="head-to-head pairs (--in-engine: rounds), default 40 (20)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "dormant_floor.json")
    ap.add_argument("--in-engine", action="store_true", help="the hooks' cost in one engine (see above)")
    ap.add_argument("--awake", action="store_true", help="the awake path's cost in one engine (see above)")
    args = ap.parse_args(argv)
    args.concurrency = args.concurrency or ([1, 4, 16, 64] if args.in_engine else [1, 4] if args.awake else [16, 64])
    args.pairs = args.pairs or (20 if args.in_engine or args.awake else 40)
    if args.out == ap.get_default("out") and (args.in_engine or args.awake):
        args.out = args.out.with_name("dormant_hooks.json" if args.in_engine else "awake_path.json")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import tempfile

    os.environ.setdefault("VLLM_DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark_cache_"))
    from bench_dspark import pair_summary

    from vllm_dspark.benchmarking import (ENGINE_DEFAULTS, TINY_DRAFTER, TINY_TARGET, measure_head_to_head,
                                          measure_offline, start_engine, stop_engine, write_record)
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()]
    if args.awake or args.in_engine:  # one engine held (and, --awake, a no-spec one beside it)
        t0 = time.time()
        rows = (awake_path if args.awake else in_engine)(args, prompts)
        record = {"command": " ".join(["python", "benchmarks/bench_dormant_floor.py", *(argv or sys.argv[1:])]),
                  "machine": machine_info(), "dtype": ENGINE_DEFAULTS["dtype"], "max_tokens": args.max_tokens,
                  "awake": args.awake, "concurrency": rows, "wall_seconds": round(time.time() - t0, 1)}
        write_record(record, args.out, plot if args.awake else plot_hooks, "floor")
        return record
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
