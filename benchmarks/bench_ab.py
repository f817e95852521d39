"""Two versions of the plugin head to head, in one run on one machine.

    python benchmarks/bench_ab.py --base d978fad                    # c = 1 and 16, 30 pairs each, ~8 min
    python benchmarks/bench_ab.py --base d978fad --head 1a2b3c4 --concurrency 4 --pairs 20

Each side is a DSpark engine (default knobs, K=7: the adaptive controller) in
its own process, loading ``vllm_dspark`` from its own copy of the package:
``--base`` (and ``--head``, default the working tree) are extracted from git
into a temporary folder. The two engines stay up side by side; at each
concurrency they run one round each, back to back, ``--pairs`` times, the
order swapped every pair (ABBA), as bench_dspark.py's head-to-head phase
does. Integrity next to throughput: every round's output token count is
checked against what ignore_eos guarantees, and at the end both sides'
greedy outputs on a sample of prompts are compared token for token (in
bf16 two runs may part at a near-tie whose winner depends on the verify
step's shape; the count of identical outputs is reported). Writes JSON
(both commits, machine, every pair, each side's controller snapshot) and a
PNG of the per-pair ratios.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


class Side:
    """One engine process (ab_engine.py) and its replies."""

    def __init__(self, name: str, root: Path, config: dict, log_dir: Path):
        self.name, self.root = name, root
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "VLLM_LOGGING_LEVEL": "WARNING"}
        self.log = open(log_dir / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "ab_engine.py"), str(root),
                                      json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=REPO)

    def wait(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ab "):
                return json.loads(line[5:])
            self.log.write(line)
        raise RuntimeError(f"{self.name}: engine process ended (exit {self.proc.wait()}); see {self.log.name}")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
            except (RuntimeError, BrokenPipeError):
                pass
            self.proc.wait(timeout=120)
        self.log.close()


def extract(commit: str, into: Path) -> str:
    """The package as of ``commit``, under ``into``; returns the full commit id."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=REPO, capture_output=True, text=True, check=True)
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit, "vllm_dspark"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return full.stdout.strip()


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench_dspark import plot_pairs

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(1.0, color="grey", linewidth=1)
    plot_pairs(ax, [(f"c={row['c']}", row) for row in record["concurrency"]],
               f"{record['head']['label']} / {record['base']['label']}, per pair (bar: median)")
    fig.suptitle(f"{record['machine']['cpu']} x{record['machine']['cores']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git commit of the baseline")
    ap.add_argument("--head", default=None, help="git commit of the other side (default: the working tree)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--identity-prompts", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "ab_commits.json")
    args = ap.parse_args(argv)
    from bench_dspark import pair_summary

    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, write_record
    from vllm_dspark.fingerprint import machine_info

    work = Path(tempfile.mkdtemp(prefix="dspark_ab_"))
    base_id = extract(args.base, work / "base")
    if args.head:
        head_root, head_id = work / "head", extract(args.head, work / "head")
    else:
        head_root, head_id = REPO, "working tree"
    config = {"target": str(REPO / TINY_TARGET), "max_num_seqs": max(args.concurrency), "dtype": args.dtype,
              "prompts": str(REPO / "examples" / "prompts" / "heldout.jsonl"),
              "spec": {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7},
              "knobs": {"persist_cost_model": False}}
    t0 = time.time()
    sides = {}
    try:
        for name, root in (("base", work / "base"), ("head", head_root)):
            sides[name] = Side(name, root, config, work)
            ready = sides[name].wait()  # one engine start at a time: they share two cores
            print(f"[ab] {name}: {ready['plugin']}", flush=True)
            assert Path(ready["plugin"]).resolve().is_relative_to(Path(root).resolve()), ready
        rows = []
        for c in args.concurrency:
            n = c * max(2, 4 // c)  # the head-to-head round of bench_dspark.py
            rates, bad = [], []
            for i in range(args.pairs):
                order = ("head", "base") if i % 2 == 0 else ("base", "head")
                got = {name: sides[name].ask(op="round", concurrency=c, requests=n, max_tokens=args.max_tokens)
                       for name in order}
                bad += [(i, name) for name, r in got.items() if r["output_tokens"] != n * args.max_tokens]
                rates.append((got["head"]["tokens_per_s"], got["base"]["tokens_per_s"]))
            row = {"c": c, "requests_per_round": n, **pair_summary(rates), "rounds_with_wrong_token_count": bad,
                   "snapshots": {name: side.ask(op="snapshot")["snapshot"] for name, side in sides.items()}}
            rows.append(row)
            print(f"[ab] c={c}: head / base = {row['median']:.3f} (median of {args.pairs} pairs; 90% interval "
                  f"{row['interval90'][0]:.2f}-{row['interval90'][1]:.2f}); wrong token counts: {len(bad)}",
                  flush=True)
        outs = {name: side.ask(op="outputs", requests=args.identity_prompts, max_tokens=args.max_tokens)["token_ids"]
                for name, side in sides.items()}
    finally:
        for side in sides.values():
            side.close()
    same = sum(a == b for a, b in zip(outs["head"], outs["base"]))
    print(f"[ab] greedy outputs identical on {same} of {args.identity_prompts} prompts", flush=True)
    record = {"command": " ".join(["python", "benchmarks/bench_ab.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "dtype": args.dtype, "max_tokens": args.max_tokens,
              "base": {"label": f"base {args.base}", "commit": base_id},
              "head": {"label": f"head {args.head or 'working tree'}", "commit": head_id},
              "concurrency": rows, "identical_greedy_outputs": {"prompts": args.identity_prompts, "identical": same},
              "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "ab")
    return record


if __name__ == "__main__":
    main()
