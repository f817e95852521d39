"""CPU time of the controller's whole per-step path, without an engine.

    python benchmarks/bench_controller_step.py            # ~1 min
    python benchmarks/bench_controller_step.py --requests 4 --steps 2000

Each step makes the runner's calls: begin_step, observe (last step's
outcomes), plan and, when it drafts, choose (this step's lengths), then
end_step; the step's time comes from a simulated clock. Step and
drafting times come from a fixed synthetic curve (a plain step 4 ms + 0.1 ms
a request, 0.15 ms per verified draft token, drafting 1.5 ms + 0.05 ms a
request + 0.1 ms a walked position) and acceptance is geometric (0.75 a
position), so every run takes the same decisions: adaptive drafts at 1 and
4 requests and goes dormant from 16. Only the controller's own time is
measured (wall clock around its calls, single thread). Policy `full`, the
least any DSpark step does, is the baseline. Writes JSON and a PNG.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

K = 7
ACCEPT = 0.75


def _step_seconds(reqs: int, drafts: int, depth: int | None) -> tuple[float, float]:
    """(whole step, drafting part) on the synthetic curve; depth None: no drafting."""
    target = 4e-3 + 1e-4 * reqs + 1.5e-4 * drafts
    draft = 0.0 if depth is None else 1.5e-3 + 5e-5 * reqs + 1e-4 * depth
    return target + draft, draft


def run(policy: str, reqs: int, steps: int, seed: int = 0) -> dict:
    import torch

    from vllm_dspark.config import DSparkKnobs
    from vllm_dspark.controller.controller import DSparkController
    from vllm_dspark.controller.plan import DraftBlocks, StepTiming, StepView, VerifyOutcome

    clock = [0.0]
    ctl = DSparkController(DSparkKnobs(policy=policy, persist_cost_model=False), K, now=lambda: clock[0])
    ids = [f"r{i}" for i in range(reqs)]
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(seed)
    caps, greedy = [K] * reqs, [True] * reqs
    requests = SimpleNamespace(req_ids=ids, caps=lambda: caps)
    lengths = None
    times = []
    skipped = 0
    for _ in range(steps):
        tokens = reqs + sum(lengths or ())  # this step verifies last step's lengths
        view = StepView(tuple(ids), (), (), None, tokens, 0, bool(lengths) and tokens > reqs)
        conf = torch.randn(reqs, K, generator=gen) + 1.5
        outcome = None
        if lengths is not None:
            outcome = [next((a for a in range(n) if rng.random() >= ACCEPT), n) for n in lengths]
        t0 = time.perf_counter()
        ctl.begin_step(view)
        if outcome is not None:
            ctl.observe(VerifyOutcome(ids, lengths, outcome))
        skip = ctl.plan(requests).mode != "draft"
        new = None if skip else ctl.choose(DraftBlocks(ids, conf, caps, greedy))
        depth = ctl.depth
        seconds, draft = _step_seconds(reqs, tokens - reqs, None if skip else depth)
        clock[0] += seconds
        ctl.end_step(StepTiming(draft, 0 if skip else reqs, 0.0, 0.0 if skip else 1e-4 * depth))
        times.append(time.perf_counter() - t0)
        skipped += skip
        lengths = new
    tail = times[steps // 4:]  # past the cost models' warm-up
    return {"policy": policy, "requests": reqs, "steps": steps,
            "mean_us": 1e6 * statistics.fmean(tail), "median_us": 1e6 * statistics.median(tail),
            "drafted_share": 1 - skipped / steps, "dormant_at_end": ctl.dormancy.dormant}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in record["policies"]:
        rows = [r for r in record["results"] if r["policy"] == policy]
        ax.plot([r["requests"] for r in rows], [r["mean_us"] for r in rows], marker="o", label=f"{policy} (mean)")
        ax.plot([r["requests"] for r in rows], [r["median_us"] for r in rows], marker="x", linestyle="--",
                label=f"{policy} (median)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in the step")
    ax.set_ylabel("controller CPU time per step (µs)")
    ax.set_title("Controller's per-step path (synthetic steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--policies", nargs="+", default=["full", "adaptive"], choices=["full", "threshold", "adaptive"])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "controller_step.json")
    args = ap.parse_args(argv)
    import torch

    from vllm_dspark.benchmarking import write_record
    from vllm_dspark.fingerprint import machine_info

    torch.set_num_threads(1)  # the controller's tensors are tiny; the runner's threads are not its own
    t0 = time.time()
    results = []
    for reqs in args.requests:
        for policy in args.policies:
            row = run(policy, reqs, args.steps)
            results.append(row)
            print(f"[controller] {policy:>9} R={reqs:<3} {row['mean_us']:7.1f} us mean, {row['median_us']:7.1f} us "
                  f"median per step; drafted {100 * row['drafted_share']:.0f}% of steps", flush=True)
    record = {"command": " ".join(["python", "benchmarks/bench_controller_step.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "block_len": K, "acceptance_per_position": ACCEPT,
              "policies": args.policies, "results": results, "wall_seconds": round(time.time() - t0, 1)}
    write_record(record, args.out, plot, "controller")
    return record


if __name__ == "__main__":
    main()
