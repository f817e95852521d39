"""Issue 19's cold-start bound on real engines: over the first 2,000 generated
tokens of a fresh engine (no persisted costs), adaptive loses at most 5%
against no speculation.

    python benchmarks/bench_cold_start.py                      # c = 1, 4, 16; 6 pairs each, ~18 min
    python benchmarks/bench_cold_start.py --concurrency 1 --pairs 6 --dtype float32
    python benchmarks/bench_cold_start.py --concurrency 16 --pairs 12 --add   # pool with --out's pairs

Per pair, a fresh no-spec engine and a fresh adaptive DSpark engine (each with
an empty cost cache, started in the order ABBA across pairs) each generate
waves of c greedy requests of --max-tokens until --tokens are out. Both
engines are up at once and take turns wave by wave (ABBA), so both see the
same spells of a shared machine: on a KVM guest, trials of two live no-spec
engines taking turns, minutes apart, differed in speed by up to 1.2x while
the two engines of a trial stayed within 5% of each other (bench_engine_drift.py,
docs/benchmarks.md); run one after the other, a pair measured that drift.
An engine's clock runs only over its own waves, from its first request
(engine start-up is not counted, for either arm), and covers every one-time
cost after it: vLLM's first shapes, the drafter's first calls, the
controller's first episode. The figure is adaptive / no-spec tok/s per
pair; the verdict wants the pooled median at least 0.95. With --add, the
pairs already in --out (same dtype, token counts and schedule; each keeps
the commit it ran at) pool with the new ones. Integrity: every
request's length, and greedy identity of adaptive's outputs against no-spec's
in the same pair (counted: in bf16 near-ties may part). Writes JSON (machine,
versions, every engine's run and the adaptive controller's totals) and a PNG.
The simulator's version of the bound is in docs/simulator.md.
"""

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

BOUND = 0.95
ARMS = ("nospec", "adaptive")


SCHEDULE = "interleaved"  # the arms take turns wave by wave; records without this key ran one after the other


def fresh_engine(arm: str, c: int, args):
    """A fresh engine of ``arm``, with nothing persisted."""
    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, start_engine

    os.environ["VLLM_DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark_cold_")  # read at engine start
    spec = None if arm == "nospec" else {"method": "dspark", "model": str(REPO / TINY_DRAFTER),
                                         "num_speculative_tokens": 7}
    return start_engine(str(REPO / TINY_TARGET), c, spec=spec, dtype=args.dtype)


def pair(c: int, p: int, prompts: list[str], args) -> dict:
    """Two fresh engines up at once, their first --tokens generated tokens
    timed wave by wave, taking turns (ABBA)."""
    from vllm import SamplingParams

    from vllm_dspark.benchmarking import stop_engine, take_turns

    order = ARMS if p % 2 == 0 else ARMS[::-1]
    engines = {}
    try:
        for arm in order:
            engines[arm] = fresh_engine(arm, c, args)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        batches = [prompts[w * c:(w + 1) * c] for w in range(math.ceil(args.tokens / (c * args.max_tokens)))]
        seconds, outs = take_turns([engines[arm] for arm in order], batches, params)
        snap = engines["adaptive"].collective_rpc("dspark_snapshot")[0]
    finally:
        for llm in engines.values():
            stop_engine(llm)
    runs, ids = {}, {}
    for arm, secs, out in zip(order, seconds, outs):
        ids[arm] = [list(o.outputs[0].token_ids) for o in out]
        tokens = sum(map(len, ids[arm]))
        runs[arm] = {"arm": arm, "seconds": sum(secs), "tokens": tokens, "requests": len(ids[arm]),
                     "lengths_ok": all(len(i) == args.max_tokens for i in ids[arm]),
                     "tokens_per_s": tokens / sum(secs)}
    runs["adaptive"]["controller"] = {k: snap.get(k) for k in ("steps", "skipped_steps", "plain_steps", "depth_hist",
                                                               "length_hist", "dormant", "speculation_excess")}
    base, ad = runs["nospec"], runs["adaptive"]
    same = sum(a == b for a, b in zip(ids["adaptive"], ids["nospec"]))
    out = {"order": list(order), "runs": runs, "ratio": ad["tokens_per_s"] / base["tokens_per_s"],
           "identical": [same, ad["requests"]]}
    print(f"[cold] c={c} pair {p + 1}/{args.pairs}: no-spec {base['tokens_per_s']:.0f} tok/s, adaptive "
          f"{ad['tokens_per_s']:.0f} ({out['ratio']:.3f}x), identical {same}/{ad['requests']}", flush=True)
    return out


def summarize(pairs: list[dict]) -> dict:
    from bench_dspark import bootstrap_median_interval

    ratios = [p["ratio"] for p in pairs]
    med, (lo, hi) = statistics.median(ratios), bootstrap_median_interval(ratios)
    ok = all(r["lengths_ok"] for p in pairs for r in p["runs"].values())
    return {"median": med, "interval90": [lo, hi], "pairs": len(ratios), "integrity_ok": ok,
            "identical": [sum(p["identical"][0] for p in pairs), sum(p["identical"][1] for p in pairs)],
            "verdict": ("OK" if med >= BOUND else "MISS") + (f", interval straddles {BOUND}" if lo < BOUND <= hi else "")}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, row in enumerate(record["concurrency"]):
        ratios = [p["ratio"] for p in row["pairs"]]
        s = row["summary"]
        ax.scatter([i] * len(ratios), ratios, color="tab:blue", alpha=0.6, s=18)
        ax.errorbar(i, s["median"], yerr=[[s["median"] - s["interval90"][0]], [s["interval90"][1] - s["median"]]],
                    fmt="D", color="black", capsize=4)
    ax.axhline(BOUND, color="red", linestyle="--", linewidth=1, label=f"bound {BOUND}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(record["concurrency"])), [f"c={r['c']}" for r in record["concurrency"]])
    ax.set_ylabel(f"adaptive / no-spec, first {record['tokens']} tokens")
    m = record["machine"]
    ax.set_title(f"cold start, fresh engines taking turns ({record['dtype']}): pairs, median and 90% interval\n"
                 f"{m.get('cpu')} x{m.get('cores')}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def earlier_pairs(args) -> dict[int, list[dict]]:
    """--out's pairs per concurrency, each with the commit it ran at; an error
    where its settings differ from these (pooling them would mix figures)."""
    import json

    if not args.out.exists():
        return {}
    old = json.loads(args.out.read_text())
    mine = {"dtype": args.dtype, "tokens": args.tokens, "max_tokens": args.max_tokens, "schedule": SCHEDULE}
    theirs = {k: old.get(k, "sequential" if k == "schedule" else None) for k in mine}
    if theirs != mine:
        raise SystemExit(f"--add: {args.out} was run with {theirs}, not {mine}; pass those, or another --out")
    from vllm_dspark.benchmarking import record_commit

    commit = record_commit(args.out)
    return {row["c"]: [{"commit": commit, **p} for p in row["pairs"]] for row in old["concurrency"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--pairs", type=int, default=6, help="fresh engine pairs per concurrency")
    ap.add_argument("--tokens", type=int, default=2000, help="generated tokens timed per engine (rounded up to waves)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "cold_start.json")
    ap.add_argument("--add", action="store_true", help="pool with the pairs already in --out (see above)")
    args = ap.parse_args(argv)
    from vllm_dspark.benchmarking import head_commit, write_record
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()]
    earlier = earlier_pairs(args) if args.add else {}
    commit = head_commit()
    t0, rows = time.time(), []
    for c in args.concurrency:
        pairs = earlier.get(c, []) + [{**pair(c, p, prompts, args), "commit": commit} for p in range(args.pairs)]
        rows.append({"c": c, "pairs": pairs, "summary": summarize(pairs)})
        s = rows[-1]["summary"]
        print(f"[cold] c={c}: adaptive / no-spec {s['median']:.3f} (90% {s['interval90'][0]:.2f}-"
              f"{s['interval90'][1]:.2f}) over {s['pairs']} pairs: {s['verdict']}", flush=True)
    record = {"command": " ".join(["python", "benchmarks/bench_cold_start.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "dtype": args.dtype, "tokens": args.tokens, "max_tokens": args.max_tokens,
              "schedule": SCHEDULE, "bound": BOUND, "concurrency": rows, "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "cold")
    return record


if __name__ == "__main__":
    main()
