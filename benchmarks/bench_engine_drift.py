"""Which noise does a benchmark on this machine fight: engines that differ, or a machine that drifts?

    python benchmarks/bench_engine_drift.py                    # c=1, 6 trials of 2 engines, ~8 min
    python benchmarks/bench_engine_drift.py --concurrency 4 --trials 6

Per trial, two fresh no-spec engines (the same model and settings) are up at
once and take turns, one wave each, in ABBA order, --rounds times; a trial
starts a minute or so after the last one ended (two engines' start-up). Two
figures follow: how far apart the two live engines of a trial run (engine B
/ engine A, each over its own waves), and how far the trials' speeds
(both engines' mean) stand apart. If the engines of a trial agree and the
trials do not, the machine drifts over minutes, and an arm measured after
another measures that drift: arms must take turns while both are up
(bench_cold_start.py, the matrix's waves). Writes JSON (machine, versions,
every wave's time) and a PNG. Run it under the environment that the
benchmark it speaks for runs under (e.g. ONEDNN_MAX_CPU_ISA=AVX2).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def trial(c: int, prompts: list[str], args) -> dict:
    from vllm import SamplingParams

    from vllm_dspark.benchmarking import TINY_TARGET, start_engine, stop_engine, take_turns

    engines = []
    try:
        for _ in range(2):
            engines.append(start_engine(str(REPO / TINY_TARGET), c, dtype=args.dtype))
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        batches = [prompts[(r * c) % len(prompts):][:c] for r in range(args.rounds)]
        seconds, _ = take_turns(engines, batches, params)
    finally:
        for llm in engines:
            stop_engine(llm)
    speed = [len(s) * c * args.max_tokens / sum(s) for s in seconds]
    return {"seconds": seconds, "tokens_per_s": speed, "b_over_a": speed[1] / speed[0]}


def summarize(trials: list[dict]) -> dict:
    ratios = [t["b_over_a"] for t in trials]
    speeds = [statistics.mean(t["tokens_per_s"]) for t in trials]
    return {"live_pair_ratio": {"min": min(ratios), "max": max(ratios), "mean": statistics.mean(ratios)},
            "trial_speed_tok_s": {"min": min(speeds), "max": max(speeds)},
            "trials_max_over_min": max(speeds) / min(speeds)}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, t in enumerate(record["trials"]):
        for e, (mark, name) in enumerate((("o", "engine A"), ("s", "engine B"))):
            left.scatter([i + 0.1 * (e - 0.5)], [t["tokens_per_s"][e]], marker=mark, color=f"C{e}",
                         label=name if i == 0 else None)
    left.set_xlabel("trial (a minute or so apart)")
    left.set_ylabel(f"output tok/s, c={record['concurrency']}")
    left.set_title("two live no-spec engines taking turns, per trial", fontsize=10)
    left.legend(fontsize=8)
    right.bar(range(len(record["trials"])), [t["b_over_a"] - 1 for t in record["trials"]], bottom=1, color="C2")
    right.axhline(1.0, color="grey", linewidth=1)
    right.set_xlabel("trial")
    right.set_ylabel("engine B / engine A")
    s = record["summary"]
    right.set_title(f"live pair {s['live_pair_ratio']['min']:.3f}-{s['live_pair_ratio']['max']:.3f}; "
                    f"trials {s['trials_max_over_min']:.2f}x apart", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    m = record["machine"]
    fig.suptitle(f"{m.get('cpu')} x{m.get('cores')} ({record['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=12, help="waves per engine in a trial")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "engine_drift.json")
    args = ap.parse_args(argv)
    from vllm_dspark.benchmarking import write_record
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()]
    t0, trials = time.time(), []
    for i in range(args.trials):
        trials.append(trial(args.concurrency, prompts, args))
        t = trials[-1]
        print(f"[drift] trial {i + 1}/{args.trials}: engine A {t['tokens_per_s'][0]:.0f} tok/s, engine B "
              f"{t['tokens_per_s'][1]:.0f} (B/A {t['b_over_a']:.3f})", flush=True)
    record = {"command": " ".join(["python", "benchmarks/bench_engine_drift.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "dtype": args.dtype, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "trials": trials,
              "summary": summarize(trials), "wall_seconds": round(time.time() - t0, 1)}
    s = record["summary"]
    print(f"[drift] live pairs B/A {s['live_pair_ratio']['min']:.3f}-{s['live_pair_ratio']['max']:.3f}; "
          f"trials {s['trial_speed_tok_s']['min']:.0f}-{s['trial_speed_tok_s']['max']:.0f} tok/s "
          f"({s['trials_max_over_min']:.2f}x)", flush=True)
    write_record(record, args.out, plot, "drift")
    return record


if __name__ == "__main__":
    main()
