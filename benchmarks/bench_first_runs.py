"""What a fresh engine's first runs of each step shape cost, before and after a change.

    python benchmarks/bench_first_runs.py --base 4e5ac88 --runs 3    # ~6 min on a 2-core AMD EPYC

On CPU a token count's first forward builds its kernels (oneDNN
primitives), so a fresh engine's first verify steps at each count run
slower than later ones: time that a fresh engine's first trial books as
drafting's loss. Each side (``--base``, and ``--head``, default the working
tree, extracted as bench_ab.py does) starts fresh engines one at a time,
in ABBA order over ``--runs``, each tracing its steps
(``VLLM_DSPARK_TRACE_DIR``) through two rounds at one request and two at
four (adaptive policy, held-out prompts, greedy, 128 tokens). Per
(requests, tokens, verifies) shape run at least ``MIN_RUNS`` times, the
first run's excess is its time over the median of that shape's runs from
the fifth on. Integrity: every round's output token count. Writes JSON
(every shape, each run's start-up warm-up from the snapshot, machine) and a
PNG.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

MIN_RUNS = 9  # a shape's runs before its first run's excess is read (its median from the fifth on)
ROUNDS = ((1, 4), (1, 4), (4, 8), (4, 8))  # (concurrency, requests) per round, in order


def first_run_excess(trace: Path) -> list[dict]:
    """Per step shape seen at least MIN_RUNS times: its first run's seconds over its median from the fifth run."""
    from vllm_dspark.controller.trace import load_trace

    shapes: dict[tuple, list[float]] = {}
    for step in load_trace(trace).steps:
        shapes.setdefault((step["reqs"], step["tokens"], bool(step["verifies"])), []).append(step["seconds"])
    return [{"reqs": r, "tokens": t, "verifies": v, "runs": len(s), "first_s": s[0],
             "excess_s": s[0] - statistics.median(s[4:])}
            for (r, t, v), s in shapes.items() if len(s) >= MIN_RUNS]


def run_engine(name: str, root: Path, config: dict, work: Path, i: int) -> dict:
    from bench_ab import Side

    trace_dir = work / f"trace-{name}-{i}"
    trace_dir.mkdir()
    os.environ["VLLM_DSPARK_TRACE_DIR"] = str(trace_dir)
    t0 = time.time()
    side = Side(f"{name}-{i}", root, config, work)
    try:
        side.wait()
        ready_s = time.time() - t0
        rounds = [{**side.ask(op="round", concurrency=c, requests=n, max_tokens=config["max_tokens"]),
                   "concurrency": c, "requests": n} for c, n in ROUNDS]
        snap = side.ask(op="snapshot")["snapshot"]
    finally:
        side.close()
        del os.environ["VLLM_DSPARK_TRACE_DIR"]
    shapes = [s for f in trace_dir.glob("trace-*.jsonl") for s in first_run_excess(f)]
    verify = [s["excess_s"] for s in shapes if s["verifies"]]
    out = {"side": name, "ready_s": round(ready_s, 1), "warm_up": snap.get("warm_up"), "rounds": rounds,
           "tokens_ok": all(r["output_tokens"] == r["requests"] * config["max_tokens"] for r in rounds),
           "verify_shapes": len(verify), "verify_first_excess_ms": round(1e3 * sum(verify), 1),
           "verify_first_excess_median_ms": round(1e3 * statistics.median(verify), 2) if verify else None,
           "shapes": shapes}
    print(f"[first-runs] {name} run {i}: {len(verify)} verify shapes, first runs {out['verify_first_excess_ms']} ms "
          f"over their medians (median {out['verify_first_excess_median_ms']} ms a shape); warm-up "
          f"{out['warm_up']}; tokens ok: {out['tokens_ok']}", flush=True)
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sides = [record["base"]["label"], record["head"]["label"]]
    for x, side in enumerate(("base", "head")):
        runs = [r for r in record["runs"] if r["side"] == side]
        left.scatter([x] * len(runs), [r["verify_first_excess_ms"] for r in runs], color=f"C{x}")
        shapes = [1e3 * s["excess_s"] for r in runs for s in r["shapes"] if s["verifies"]]
        right.boxplot(shapes, positions=[x], widths=0.5)
    for ax, title in ((left, "verify steps' first runs over their medians, a fresh engine (ms)"),
                      (right, "per verify shape (ms)")):
        ax.set_xticks([0, 1], sides)
        ax.axhline(0, color="grey", linewidth=1)
        ax.set_title(title, fontsize=9)
    m = record["machine"]
    fig.suptitle(f"{m['cpu']} x{m['cores']}, {record['dtype']}: rounds at c=1 then c=4", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--head", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "first_runs.json")
    args = ap.parse_args(argv)
    from bench_ab import extract

    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, write_record
    from vllm_dspark.fingerprint import machine_info

    work = Path(tempfile.mkdtemp(prefix="dspark_first_runs_"))
    roots = {"base": (work / "base", extract(args.base, work / "base"))}
    roots["head"] = (work / "head", extract(args.head, work / "head")) if args.head else (REPO, "working tree")
    config = {"target": str(REPO / TINY_TARGET), "max_num_seqs": 4, "dtype": args.dtype, "max_tokens": 128,
              "prompts": str(REPO / "examples" / "prompts" / "heldout.jsonl"),
              "spec": {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7},
              "knobs": {"persist_cost_model": False}}
    runs = []
    for i in range(args.runs):
        for name in (("base", "head") if i % 2 == 0 else ("head", "base")):
            runs.append(run_engine(name, roots[name][0], config, work, i))
    summary = {side: {"verify_first_excess_ms": [r["verify_first_excess_ms"] for r in runs if r["side"] == side],
                      "warm_up": [r["warm_up"] for r in runs if r["side"] == side],
                      "ready_s": [r["ready_s"] for r in runs if r["side"] == side]} for side in ("base", "head")}
    record = {"command": " ".join(["python", "benchmarks/bench_first_runs.py", *argv]), "machine": machine_info(),
              "dtype": args.dtype, "rounds": ROUNDS, "min_runs": MIN_RUNS,
              "base": {"label": f"base {args.base}", "commit": roots["base"][1]},
              "head": {"label": f"head {args.head or 'working tree'}", "commit": roots["head"][1]},
              "summary": summary, "integrity_ok": all(r["tokens_ok"] for r in runs), "runs": runs}
    for side, s in summary.items():
        print(f"[first-runs] {side}: first runs of verify shapes {s['verify_first_excess_ms']} ms; "
              f"engine ready in {s['ready_s']} s", flush=True)
    write_record(record, args.out, plot, "first-runs", argv)
    return record


if __name__ == "__main__":
    main()
