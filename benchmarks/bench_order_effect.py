"""Does the head to head's order bias it? Two no-spec engines, and a DSpark engine held dormant, each
against a no-spec engine in ABBA pairs, with and without settling.

    python benchmarks/bench_order_effect.py                  # c=4, 10 pairs, 2 repeats, ~7 min
    python benchmarks/bench_order_effect.py --concurrency 16 --pairs 10

ABBA order runs each pair's second engine right after the other one's round
(A B | B A | A B ...), so that round carries whatever running another engine
leaves behind (its caches, here). "plain" measures every round; "settled"
(what ``measure_head_to_head`` does) runs an engine once unmeasured before a
round that follows the other engine's. For each, the pairs whose second
engine is the reference (even) and whose second engine is the one measured
(odd) are summarised apart: an order effect splits them. The second no-spec
engine is the control: whatever it is, it is not DSpark. Writes JSON
(machine, versions, every pair) and a PNG.
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

ENGINES = ("nospec-2", "dspark-held")


def summary(rates: list[tuple[float, float]]) -> dict:
    from bench_dspark import bootstrap_median_interval

    ratios = [a / b for a, b in rates]
    even, odd = ratios[0::2], ratios[1::2]
    return {"pairs": rates, "median": statistics.median(ratios), "interval90": bootstrap_median_interval(ratios),
            "median_reference_second": statistics.median(even), "median_measured_second": statistics.median(odd)}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["modes"]), figsize=(11, 4), sharey=True)
    for ax, (mode, rows) in zip(axes, record["modes"].items()):
        for i, name in enumerate(ENGINES):
            for rep, row in enumerate(rows[name]):
                ratios = [a / b for a, b in row["pairs"]]
                x = i + 0.15 * (rep - 0.5)
                ax.scatter([x] * len(ratios[0::2]), ratios[0::2], s=12, color="tab:blue",
                           label="no-spec ran second" if i == rep == 0 else None)
                ax.scatter([x] * len(ratios[1::2]), ratios[1::2], s=12, color="tab:orange",
                           label="measured engine ran second" if i == rep == 0 else None)
                ax.plot([x - 0.06, x + 0.06], [row["median"]] * 2, color="black")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xticks(range(len(ENGINES)), [f"{n} / no-spec" for n in ENGINES])
        ax.set_title(f"{mode}: per pair (bar: median)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "order_effect.json")
    args = ap.parse_args(argv)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # hold_dormant goes through collective_rpc
    import tempfile

    os.environ.setdefault("VLLM_DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark_cache_"))
    from bench_dormant_floor import hold_dormant

    from vllm_dspark.benchmarking import (TINY_DRAFTER, TINY_TARGET, measure_head_to_head, measure_offline,
                                          start_engine, stop_engine, write_record)
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()]
    c = args.concurrency
    spec = {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7}
    t0 = time.time()
    engines = {"nospec": start_engine(str(REPO / TINY_TARGET), c), "nospec-2": start_engine(str(REPO / TINY_TARGET), c),
               "dspark-held": start_engine(str(REPO / TINY_TARGET), c, spec=spec, knobs={"persist_cost_model": False})}
    modes = {"plain": {n: [] for n in ENGINES}, "settled": {n: [] for n in ENGINES}}
    try:
        engines["dspark-held"].collective_rpc(hold_dormant)
        for llm in engines.values():
            measure_offline(llm, prompts[:4], 4, 16)  # warm-up
        for rep in range(args.repeats):
            for mode, rows in modes.items():
                for name in ENGINES:
                    rates = measure_head_to_head(engines[name], engines["nospec"], prompts, c, args.max_tokens,
                                                 args.pairs, settle=mode == "settled")
                    row = summary(rates)
                    rows[name].append(row)
                    print(f"[order] {mode:>7} {name} / no-spec = {row['median']:.3f} (no-spec second "
                          f"{row['median_reference_second']:.3f}, {name} second {row['median_measured_second']:.3f}; "
                          f"{args.pairs} pairs, repeat {rep + 1})", flush=True)
    finally:
        for llm in engines.values():
            stop_engine(llm)
    record = {"command": " ".join(["python", "benchmarks/bench_order_effect.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "concurrency": c, "max_tokens": args.max_tokens, "modes": modes,
              "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "order")
    return record


if __name__ == "__main__":
    main()
