"""What one more walk position costs and yields, inside one engine, with the
depth drawn at random per step: the ground truth the gate's depth choice is
made against.

    python benchmarks/bench_depth_economics.py                      # depths 3 and 7, c=1, ~3 min
    python benchmarks/bench_depth_economics.py --depths 2 4 7 --concurrency 4 --dtype float32

One DSpark engine in this process (the "uni" executor, as bench_step_phases.py),
policy full with K = the deepest depth asked, traced. Each step's walk depth
(and so its parallel block, depth_sized_block) is drawn at random from
``--depths`` (seeded) in place of the controller's: the depth is then
independent of the machine's drift, so steps of different depths side by
side measure what a depth costs, where the adaptive controller's own steps
(depth chosen from the same models that price it) cannot. Full verification
of whatever was walked: every drafted token is verified, so each position's
survival is measured too.

Reported from the trace (JSON + PNG under benchmarks/results/latest/):
- per position, the marginal cost of the parallel block and of the walk
  (adjacent steps of different depths, paired), and of a verified token
  (adjacent verify steps of different token counts, paired), with 90%
  intervals;
- per position, the measured survival (blocks verified that far);
- per depth, tokens per second over the steps that ran at that depth after
  a step at the same depth (as an engine held at that depth would run),
  with the best depth marked.
A no-spec engine in the same process takes turns with it round by round:
its wall-clock tok/s is the run's baseline. Integrity: every request's
output length is checked against ignore_eos, and both engines' greedy
outputs on a sample of prompts are compared token for token.
"""

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

Z90 = 1.645


def paired(steps: list[dict], key, gap) -> dict | None:
    """Slope of ``key(step)`` per unit of ``gap(step)`` over adjacent steps
    (same batch, consecutive step numbers) whose ``gap`` differs: through the
    origin on the differences, so a drift slower than a step cancels."""
    num = den = 0.0
    pairs = []
    for a, b in zip(steps, steps[1:]):
        if b["step"] != a["step"] + 1 or b["reqs"] != a["reqs"]:
            continue
        dx = gap(b) - gap(a)
        if dx:
            dy = key(b) - key(a)
            pairs.append((dx, dy))
            num, den = num + dx * dy, den + dx * dx
    if len(pairs) < 10:
        return None
    slope = num / den
    resid = sum((dy - slope * dx) ** 2 for dx, dy in pairs) / (len(pairs) - 1)
    se = math.sqrt(resid / den)
    return {"us": slope * 1e6, "interval90_us": [(slope - Z90 * se) * 1e6, (slope + Z90 * se) * 1e6],
            "pairs": len(pairs)}


def analyse(trace, rows: int, depths: list[int]) -> dict:
    k = trace.block_len
    # Decode steps of the whole batch that verify drafts and draft again (no prompt work).
    steps = sorted((s for s in trace.steps if s["reqs"] == rows and s.get("verifies") and s.get("drafted") == rows
                    and s.get("depth") and s["tokens"] <= rows * (k + 1)), key=lambda s: s["step"])
    costs = {
        "parallel block, a position": paired(steps, lambda s: s["draft_seconds"] - s["walk_seconds"],
                                             lambda s: s["depth"]),
        "walk, a position": paired(steps, lambda s: s["walk_seconds"], lambda s: s["depth"]),
        "verified token": paired(steps, lambda s: s["seconds"] - s["draft_seconds"], lambda s: s["tokens"] / rows),
    }
    blocks = [b for blocks in trace.requests.values() for b in blocks]
    survival = []
    for j in range(1, k + 1):
        reached = [b for b in blocks if b[3] >= j]
        if len(reached) < 20:
            break
        survival.append({"position": j, "survival": sum(b[4] >= j for b in reached) / len(reached),
                         "blocks": len(reached)})
    by_number = {s["step"]: s for s in steps}
    per_depth = []
    for d in depths:
        held = [s for s in steps if s["depth"] == d and by_number.get(s["step"] - 1, {}).get("depth") == d]
        if not held:
            continue
        seconds = sum(s["seconds"] for s in held)
        tokens = sum(rows + s.get("accepted", 0) for s in held)
        per_step = [(rows + s.get("accepted", 0)) / s["seconds"] for s in held]
        spread = statistics.stdev(per_step) / math.sqrt(len(per_step)) if len(per_step) > 1 else 0.0
        per_depth.append({"depth": d, "steps": len(held), "tokens_per_s": tokens / seconds,
                          "interval90": [tokens / seconds - Z90 * spread, tokens / seconds + Z90 * spread],
                          "accepted_per_request": (tokens / len(held) - rows) / rows,
                          "step_ms": 1e3 * seconds / len(held)})
    best = max(per_depth, key=lambda r: r["tokens_per_s"])["depth"] if per_depth else None
    return {"steps_used": len(steps), "marginal_costs": costs, "survival": survival, "per_depth": per_depth,
            "best_depth": best, "fitted_verify_token_us": 1e6 * (trace.costs or {}).get("spec", {}).get("t_tok", math.nan)}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = record["result"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    names = [n for n, v in res["marginal_costs"].items() if v]
    vals = [res["marginal_costs"][n]["us"] for n in names]
    errs = [[v - res["marginal_costs"][n]["interval90_us"][0] for n, v in zip(names, vals)],
            [res["marginal_costs"][n]["interval90_us"][1] - v for n, v in zip(names, vals)]]
    a.barh(names, vals, xerr=errs, color="tab:orange")
    a.set_xlabel("µs (90% interval)")
    a.set_title("marginal cost, paired adjacent steps", fontsize=9)
    b.bar([s["position"] for s in res["survival"]], [s["survival"] for s in res["survival"]], color="tab:green")
    b.set_xlabel("draft position")
    b.set_ylabel("accepted that far, of the blocks verified that far")
    b.set_title("survival per position (full verification)", fontsize=9)
    rows = res["per_depth"]
    c.bar([str(r["depth"]) for r in rows], [r["tokens_per_s"] for r in rows],
          yerr=[[r["tokens_per_s"] - r["interval90"][0] for r in rows], [r["interval90"][1] - r["tokens_per_s"] for r in rows]],
          color=["tab:blue" if r["depth"] != res["best_depth"] else "tab:red" for r in rows])
    c.set_xlabel("walk depth (held two steps)")
    c.set_ylabel("tokens/s")
    c.set_title("throughput by depth (best in red)", fontsize=9)
    m = record["machine"]
    base = record["nospec_baseline"]
    fig.suptitle(f"{m.get('cpu', '?')} ({m.get('cpu_id', '?')}) x{m.get('cores', '?')}, {record['dtype']}, "
                 f"c={record['concurrency']}; the engine {base['dspark']:.0f} tok/s, no-spec {base['nospec']:.0f} "
                 f"(wall, same rounds); "
                 f"depths {record['depths']} drawn per step, {res['steps_used']} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=100, help="waves of --concurrency requests")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=1, help="of the depth draws")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "depth_economics.json")
    args = ap.parse_args(argv)
    if min(args.depths) < 1:
        ap.error("--depths: every depth must be at least 1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its controller reachable
    os.environ["VLLM_DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark_cache_")
    from vllm import SamplingParams

    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, measure_offline, start_engine, write_record
    from vllm_dspark.controller.trace import load_trace
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    t0, k = time.time(), max(args.depths)
    folder = Path(tempfile.mkdtemp(prefix="dspark_depth_trace_"))
    texts = [p["text"] for p in load_prompts()]
    prompts = texts[: args.concurrency]
    llm = start_engine(str(REPO / TINY_TARGET), max(args.concurrency, 4), dtype=args.dtype,
                       spec={"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": k},
                       knobs={"policy": "full", "persist_cost_model": False, "trace_dir": str(folder)},
                       distributed_executor_backend="uni")
    ctl = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.dspark
    rng, plan = random.Random(args.seed), ctl.plan

    def drawn(requests):  # the walk depth of this step's plan, drawn (on the instance only)
        ctl.depth = rng.choice(args.depths)
        return plan(requests)

    ctl.plan = drawn
    nospec = start_engine(str(REPO / TINY_TARGET), max(args.concurrency, 4), dtype=args.dtype,
                          distributed_executor_backend="uni")
    engines = {"dspark": llm, "nospec": nospec}
    for engine in engines.values():
        measure_offline(engine, prompts, args.concurrency, 16)  # warm-up
    tokens, rates = {name: 0 for name in engines}, {name: [] for name in engines}
    for i in range(args.rounds):
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):  # a drift favours neither
            sample = measure_offline(engines[name], prompts, args.concurrency, args.max_tokens)
            tokens[name] += sample.output_tokens
            rates[name].append(sample.tokens_per_s)
        if (i + 1) % 10 == 0:
            print(f"[depth] round {i + 1}/{args.rounds}: {rates['dspark'][-1]:.0f} tok/s, "
                  f"no-spec {rates['nospec'][-1]:.0f}", flush=True)
    ctl.close()
    expected = args.rounds * args.concurrency * args.max_tokens
    sample_prompts = texts[:4]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = {name: [list(o.outputs[0].token_ids) for o in e.generate(sample_prompts, greedy, use_tqdm=False)]
            for name, e in engines.items()}
    baseline = {"unit": "wall-clock tok/s, median of the same rounds (the DSpark engine at the drawn depths)",
                "nospec": statistics.median(rates["nospec"]), "dspark": statistics.median(rates["dspark"]),
                "dspark_over_nospec": statistics.median(d / n for d, n in zip(rates["dspark"], rates["nospec"]))}
    result = analyse(load_trace(folder), args.concurrency, sorted(set(args.depths)))
    for name, v in result["marginal_costs"].items():
        if v:
            print(f"[depth] {name}: {v['us']:.1f} µs ({v['interval90_us'][0]:.1f} to {v['interval90_us'][1]:.1f}), "
                  f"{v['pairs']} pairs")
    print(f"[depth] this engine {baseline['dspark']:.1f} tok/s against no-spec {baseline['nospec']:.1f} in the same "
          f"rounds ({baseline['dspark_over_nospec']:.3f}x)")
    for r in result["per_depth"]:
        print(f"[depth] depth {r['depth']}: {r['tokens_per_s']:.1f} tok/s ({r['interval90'][0]:.1f}-"
              f"{r['interval90'][1]:.1f}), {r['accepted_per_request']:.2f} accepted a step, {r['steps']} steps")
    record = {"command": " ".join(["python", "benchmarks/bench_depth_economics.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "dtype": args.dtype, "concurrency": args.concurrency,
              "depths": sorted(set(args.depths)), "rounds": args.rounds, "max_tokens": args.max_tokens,
              "integrity": {"output_tokens": tokens, "expected_each": expected,
                            "greedy_identical": sum(a == b for a, b in zip(outs["dspark"], outs["nospec"])),
                            "greedy_compared": len(sample_prompts),
                            "ok": all(n == expected for n in tokens.values())},
              "nospec_baseline": baseline, "result": result, "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "depth")
    return record


if __name__ == "__main__":
    main()
    os._exit(0)  # an in-process engine: skip its teardown
