"""Trace-driven simulator: replay recorded DSpark traces under every policy, on
CPU-measured and GPU-class step-cost curves, from batch 1 to 256.

    python -m vllm_dspark.sim --out benchmarks/results/latest/sim
    python -m vllm_dspark.sim --out DIR --trace my_traces/ --curve my_gpu.json --batch-sizes 1 8 64

Writes DIR/summary.json (one record per curve, batch size and policy:
tokens_per_s, per_request_tokens_per_s, oracle_fraction), DIR/targets.json
(the targets of the simulator issue, checked), DIR/validation.json (replay
against the measured run the trace came from), DIR/calibration.json (per
position ECE of raw and online-calibrated confidences over the trace),
DIR/curves.json (every curve's constants), DIR/provenance.json (commit,
command, machine) and one PNG per curve.
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "examples" / "traces" / "tiny-k7-full-c16"
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
POLICY_ORDER = ["nospec", "fixed-K1", "fixed-K3", "fixed-K7", "threshold", "stale", "flat-table",
                "adaptive", "calibrated-bound", "oracle"]


def run_curve(trace, curve, batch_sizes, steps, warmup, seed, log) -> list[dict]:
    from vllm_dspark.sim.curves import fit_linear
    from vllm_dspark.sim.engine import draw_blocks, oracle, replay
    from vllm_dspark.sim.policies import make_policies

    profiled = fit_linear(curve, trace.block_len, f"{curve.name}-profiled-once")
    records = []
    for r in batch_sizes:
        t0 = time.perf_counter()
        blocks = draw_blocks(trace, r, warmup + steps, seed)
        best = oracle(blocks, curve, warmup)
        results = {p.name: replay(p, blocks, curve, warmup)
                   for p in make_policies(trace, curve, r, profiled=profiled)}
        results["oracle"] = best
        for name, res in results.items():
            records.append({"curve": curve.name, "batch_size": r, "policy": name,
                            "tokens_per_s": res.tokens_per_s, "per_request_tokens_per_s": res.tokens_per_s / r,
                            "oracle_fraction": res.tokens_per_s / best.tokens_per_s,
                            "verified_per_drafting_step": res.verified / res.drafted_steps / r if res.drafted_steps else 0.0,
                            "drafting_step_fraction": res.drafted_steps / steps})
        row = {n: f"{res.tokens_per_s / best.tokens_per_s:.3f}" for n, res in results.items() if n != "oracle"}
        log(f"[sim] {curve.name:>9} R={r:<3} oracle {best.tokens_per_s:9.0f} tok/s  fractions {row}"
            f"  ({time.perf_counter() - t0:.1f}s)")
    return records


def run_cold_start(trace, curve, batch_sizes, tokens: int, seed: int, log) -> list[dict]:
    """Fresh policies (no learned costs, no calibration) over the first steps
    of a run, as many as an engine without speculation takes for ``tokens``
    generated tokens, with nothing played uncounted."""
    from vllm_dspark.sim.curves import fit_linear
    from vllm_dspark.sim.engine import draw_blocks, replay
    from vllm_dspark.sim.policies import make_policies

    profiled = fit_linear(curve, trace.block_len, f"{curve.name}-profiled-once")
    records = []
    for r in batch_sizes:
        steps = max(1, -(-tokens // r))
        blocks = draw_blocks(trace, r, steps, seed)
        results = {p.name: replay(p, blocks, curve, warmup=0) for p in make_policies(trace, curve, r, profiled=profiled)}
        base = results["nospec"].tokens_per_s
        best = max(v.tokens_per_s for n, v in results.items() if n == "nospec" or n.startswith("fixed-K"))
        for name, res in results.items():
            records.append({"curve": curve.name, "batch_size": r, "policy": name, "steps": steps,
                            "tokens_per_s": res.tokens_per_s, "vs_nospec": res.tokens_per_s / base,
                            "vs_best_fixed": res.tokens_per_s / best})
        log(f"[sim] cold start {curve.name:>9} R={r:<3} {steps} steps: adaptive "
            f"{results['adaptive'].tokens_per_s / base:.3f}x no-spec, "
            f"{results['adaptive'].tokens_per_s / best:.3f}x the best fixed arm")
    return records


def check_targets(records: list[dict], cold: list[dict] = ()) -> dict:
    """The simulator issue's targets, per curve and batch size, and the cold
    start's (adaptive loses at most 5% against no-spec)."""
    by = {(r["curve"], r["batch_size"], r["policy"]): r for r in records}
    misses, checks = [], 0
    for curve, r in sorted({(c, b) for c, b, _ in by}):
        get = lambda p: by.get((curve, r, p))  # noqa: E731
        ours = get("adaptive")["tokens_per_s"]
        base = max(v["tokens_per_s"] for (c, b, p), v in by.items()
                   if c == curve and b == r and (p == "nospec" or p.startswith("fixed-K")))
        tests = [("adaptive >= 0.97 x calibrated-bound", ours / get("calibrated-bound")["tokens_per_s"], 0.97),
                 ("adaptive >= 1.0 x best of nospec and fixed-K", ours / base, 1.0)]
        if curve.startswith("gpu"):
            tests.append(("adaptive >= 0.8 x oracle", get("adaptive")["oracle_fraction"], 0.8))
        if r >= 64:
            for other in ("stale", "flat-table"):
                tests.append((f"adaptive > {other}", ours / get(other)["tokens_per_s"], 1.0 + 1e-9))
        for name, value, bar in tests:
            checks += 1
            if value < bar:
                misses.append({"curve": curve, "batch_size": r, "target": name, "value": round(value, 4)})
    for rec in cold:
        if rec["policy"] == "adaptive":
            checks += 1
            if rec["vs_nospec"] < 0.95:
                misses.append({"curve": rec["curve"], "batch_size": rec["batch_size"],
                               "target": "cold start: adaptive >= 0.95 x no-spec", "value": round(rec["vs_nospec"], 4)})
    return {"checks": checks, "met": checks - len(misses), "misses": misses}


def plot(records: list[dict], curve: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["curve"] == curve]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy in POLICY_ORDER:
        pts = sorted((r["batch_size"], r["tokens_per_s"], r["oracle_fraction"]) for r in rows if r["policy"] == policy)
        if not pts:
            continue
        style = (dict(lw=2.8, color="black", zorder=5) if policy == "adaptive"
                 else dict(lw=1.2, ls="--" if policy == "oracle" else "-"))
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=policy, **style)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", ms=3, label=policy, **style)
    axes[0].set(xscale="log", yscale="log", xlabel="batch size (requests)", ylabel="tokens/s",
                title=f"{curve}: throughput")
    axes[1].set(xscale="log", xlabel="batch size (requests)", ylabel="fraction of the hindsight oracle",
                title=f"{curve}: goodput / oracle")
    for ax in axes:
        ax.set_xticks(BATCH_SIZES, [str(b) for b in BATCH_SIZES])
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def validate(trace, run: dict | None, cpu) -> dict | None:
    """Replay the trace on the CPU curve and compare with the run it was
    recorded in (run.json next to the trace, from benchmarks/record_traces.py):
    (1) every recorded step priced by the curve against the measured step
    times; (2) the run's own waves replayed (fixed-K7 on the recorded blocks,
    and no-spec) against the measured tokens/s."""
    from vllm_dspark.sim.engine import replay_waves
    from vllm_dspark.sim.policies import FixedK, NoSpec

    if run is None:
        return None
    priced = sum(float(cpu.spec(s["reqs"], s["tokens"]) if s.get("verifies") else cpu.plain(s["reqs"], s["tokens"]))
                 + (float(cpu.draft(s["drafted"])) if s.get("drafted") else 0.0) for s in trace.steps)
    recorded = sum(s["seconds"] for s in trace.steps)
    c = run["concurrency"]
    shape = dict(wave=c, max_tokens=run["max_tokens"], prompt_tokens=run.get("prompt_tokens", 48), curve=cpu,
                 skip_requests=run.get("warmup_requests", 0))
    out = {"concurrency": c, "step_time_replay_ratio": priced / recorded, "waves": {}}
    arms = {f"fixed-K{trace.block_len}": (FixedK(trace.block_len), run["measured"]["tokens_per_s"])}
    if "nospec" in run and str(c) in run["nospec"]["measured"]:
        arms["nospec"] = (NoSpec(), run["nospec"]["measured"][str(c)]["tokens_per_s"])
    for name, (policy, real) in arms.items():
        sim = replay_waves(policy, trace, **shape).tokens_per_s
        out["waves"][name] = {"simulated_tokens_per_s": sim, "measured_tokens_per_s": real,
                              "error_pct": 100.0 * (sim - real) / real}
    return out


def calibration_report(trace, batch: int = 16) -> dict:
    """Per-position ECE of the raw and the online-calibrated confidences over
    the trace's blocks, in recorded order, batch by batch: the plugin's own
    calibrator, each prediction scored before its outcome is learned from."""
    import torch

    from vllm_dspark.controller.calibration import PositionCalibrator

    out = {}
    for mode, greedy in (("greedy", True), ("sampled", False)):
        blocks = [b for seq in trace.requests.values() for b in seq if b[2] == greedy]
        if not blocks:
            continue
        cal = PositionCalibrator(trace.block_len)
        for i in range(0, len(blocks), batch):
            chunk = blocks[i : i + batch]
            cal.observe(torch.tensor([b[0] for b in chunk]), torch.tensor([b[3] for b in chunk]),
                        torch.tensor([b[4] for b in chunk]))
        out[mode] = {"blocks": len(blocks), "ece_raw": cal.ece("raw"), "ece_calibrated": cal.ece("calibrated")}
    return out


def main(argv=None) -> dict:
    from vllm_dspark.controller.trace import load_trace
    from vllm_dspark.sim.curves import cpu_curve, cpu_regimes, gpu_curves, json_curve, run_record

    ap = argparse.ArgumentParser(prog="python -m vllm_dspark.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a trace file or folder (policy 'full')")
    ap.add_argument("--curve", type=Path, nargs="*", default=[], help="extra cost curves (JSON, cost_curve format)")
    ap.add_argument("--no-builtin-curves", action="store_true", help="only the --curve files")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=BATCH_SIZES)
    ap.add_argument("--steps", type=int, default=600, help="measured steps per run (after warm-up)")
    ap.add_argument("--warmup", type=int, default=300,
                    help="steps each run plays first, uncounted (the controller learns costs and calibration)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold-start-tokens", type=int, default=2000,
                    help="the cold-start scenario: fresh policies over the steps a no-spec engine takes for this "
                    "many tokens (0: skip it)")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes):
        ap.error("--batch-sizes must all be >= 1")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    trace = load_trace(args.trace)
    run = run_record(args.trace)
    curves = [] if args.no_builtin_curves else [cpu_curve(trace, run), *cpu_regimes(trace.block_len),
                                                 *gpu_curves(trace.block_len)]
    curves += [json_curve(str(p), trace.block_len) for p in args.curve]
    if not curves:
        ap.error("no curves: drop --no-builtin-curves or give --curve files")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"[sim] trace {args.trace}: {len(trace.requests)} requests, {trace.num_blocks} blocks, K={trace.block_len}",
          flush=True)
    records = []
    for curve in curves:
        records += run_curve(trace, curve, args.batch_sizes, args.steps, args.warmup, args.seed,
                             lambda m: print(m, flush=True))
        plot(records, curve.name, args.out / f"sim_{curve.name}.png")
    cold = []
    if args.cold_start_tokens > 0:
        for curve in curves:
            cold += run_cold_start(trace, curve, [b for b in args.batch_sizes if b <= 64], args.cold_start_tokens,
                                   args.seed, lambda m: print(m, flush=True))
        (args.out / "cold_start.json").write_text(json.dumps(cold, indent=1))
    targets = check_targets(records, cold)
    validation = None if args.no_builtin_curves else validate(trace, run, curves[0])
    (args.out / "summary.json").write_text(json.dumps(records, indent=1))
    (args.out / "targets.json").write_text(json.dumps(targets, indent=1))
    (args.out / "curves.json").write_text(json.dumps({c.name: c.describe() for c in curves}, indent=1))
    if validation is not None:
        (args.out / "validation.json").write_text(json.dumps(validation, indent=1))
    calibration = calibration_report(trace)
    (args.out / "calibration.json").write_text(json.dumps(calibration, indent=1))
    from vllm_dspark.benchmarking import provenance

    (args.out / "provenance.json").write_text(json.dumps(provenance(sys.argv if argv is None else argv, engine=False), indent=1))
    for mode, rep in calibration.items():
        fmt = lambda xs: " ".join("-" if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"[sim] calibration ({mode}, {rep['blocks']} blocks) ECE per position raw: {fmt(rep['ece_raw'])}"
              f" | calibrated: {fmt(rep['ece_calibrated'])}", flush=True)
    print(f"[sim] targets: {targets['met']}/{targets['checks']} met", flush=True)
    for miss in targets["misses"]:
        print(f"[sim]   miss: {miss}", flush=True)
    if validation is not None:
        print(f"[sim] validation: {json.dumps(validation)}", flush=True)
    print(f"[sim] wrote {args.out}/summary.json and plots", flush=True)
    return {"records": records, "targets": targets, "validation": validation}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
