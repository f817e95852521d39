"""Issue 19's benchmark matrix: {regime} x {dtype} x {workload}, per arm, one command line.

    python benchmarks/bench_matrix.py --dry-run                     # the plan and its estimated time
    python benchmarks/bench_matrix.py                               # every cell, --runs 1
    python benchmarks/bench_matrix.py --regimes avx2cap --dtypes float32 --workloads waves --runs 3
    python benchmarks/bench_matrix.py --workloads poisson-light poisson-heavy --rates 2 30
    python benchmarks/bench_matrix.py --workloads waves --concurrency 1 --arms nospec dspark-adaptive \\
        --runs 1 --max-tokens 16 --out /tmp/matrix.json              # a smoke run

Regimes: `native` (the CPU as it is) and `avx2cap` (ONEDNN_MAX_CPU_ISA=AVX2: vLLM's bf16 linear
layers fall back to torch, as on a CPU without AVX-512). The cap must be set before torch is
imported, so every run of a cell is a process of its own (benchmarks/matrix_worker.py). On a CPU
without AVX-512 the native regime is the AVX2 one, run for real: its cells are keyed `avx2` (never
pooled with an AVX-512 CPU's `native` ones), and the cap, which changes nothing there, is skipped. Arms: nospec,
dspark-k7 and dspark-k3 (full blocks), dspark-adaptive (K=7, default policy); every engine or
server starts with a fresh cost cache (cold start).

  waves          offline, waves of c requests (greedy, ignore_eos, --max-tokens); all arms up,
                 interleaved rounds (median), then adaptive head to head (ABBA pairs) against each
                 c's best other arm, as bench_dspark.py does. Figure: output tok/s.
  poisson-light  a `vllm serve` per arm (loopback; dtype, KV bytes, max seqs of the offline engines),
  poisson-heavy  driven by `vllm bench serve` (held-out prompts as a local ShareGPT-format JSON:
                 its `custom` JSONL needs pandas; Poisson arrivals, seed 0, greedy, ignore_eos),
                 --serve-rounds rounds, arm order rotated. Light (far below capacity): figure
                 1000 / median TPOT (tok/s of one request); heavy (sustained refill, mixed prefill
                 and decode steps): output tok/s. Rates: LIGHT_SHARE x no-spec's waves c=1 tok/s and
                 HEAVY_SHARE x its c=16 tok/s (the record's waves cell of the same regime and
                 dtype), over --serve-tokens; else, or with --rates, fixed. The cell says which.
  soak           offline, SOAK_C at once under KV pressure (--soak-kv-tokens of target KV, so vLLM
                 preempts): greedy and seeded T=1 requests, lengths cycling 1/4, 1/2, 1 of
                 --max-tokens. Figure: output tok/s; wall time and preemptions (from the requests'
                 own stats) recorded.
  soak-tokens    the soak with the DSpark arms' KV bytes raised to hold as many target tokens as
                 no-spec's next to their drafter's KV (the start-up log's advice): whether the
                 soak's gap is the KV share or the speculation.

Per row: every arm's figure (median of the pooled rounds), adaptive / best other arm with a 90%
bootstrap interval (head-to-head pairs for waves, per-round ratios otherwise, each run's against the
arm best in the other runs, cross_fitted_ratios; pooled over runs),
adaptive / full K=7 where K=7 < no-spec, integrity (completions, output lengths, greedy identity of
the first --identity-prompts outputs against nospec: token ids offline, text over HTTP; required
in float32, counted in bf16, where near-ties part) and the verdict: adaptive >= 0.98x the best
other arm, and >= 1.2x full K=7 where K=7 < no-spec. A ratio within 5% of 0.98 wants >= 3 runs.

Resumable and splittable: cells merge into --out with their runs and each run's provenance
(commit, env, CPU, engine settings). A cell already holding --runs runs of the same settings is
skipped; one with fewer gets the missing runs (--fresh: rerun). Waves pool per concurrency: a run
of some c's adds rows beside the runs of others, and --fresh drops only the rows of the c's asked
for. A record of another commit in latest/ moves to history/ first (write_record's rule); its
cells are kept in the merge.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from matrix_worker import AD, K7, NS, SOAK_C  # noqa: E402

ARMS = (NS, K7, "dspark-k3", AD)
WORKLOADS = ("waves", "poisson-light", "poisson-heavy", "soak", "soak-tokens")
REGIMES = {"native": {}, "avx2cap": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
DT_SHORT = {"bfloat16": "bf16", "float32": "fp32"}
LINE, K7_LINE = 0.98, 1.2
LIGHT_SHARE, HEAVY_SHARE, FIXED_RATES = 0.5, 0.8, (2.0, 30.0)
UNITS = {"waves": "tok/s", "poisson-light": "tok/s a request (1000/median TPOT)",
         "poisson-heavy": "tok/s", "soak": "tok/s", "soak-tokens": "tok/s"}
# --dry-run's cost model (AMD EPYC x2, smoke runs and latest/dspark_vs_nospec*.json): seconds a
# worker / engine / server / client takes to start, output tok/s at c (the four arms' mean; 24 is
# the soak, preempting), the work's slowdown under the AVX2 cap. float32 is assumed as fast as bf16.
EST = {"worker": 12, "engine": 18, "server": 22, "client": 10}
EST_TOKS = {1: 300, 4: 900, 16: 2000, SOAK_C: 1300, 64: 3500}
EST_AVX2 = 2.0


def regime_label(regime: str, cpu_flags) -> str | None:
    """The regime a cell of this CPU records (None: the regime cannot run here)."""
    if "avx512f" in cpu_flags:
        return regime
    return "avx2" if regime == "native" else None


def regime_blocked(regime: str, dtype: str, cpu_flags) -> str | None:
    """Why a regime's dtype cannot run on this CPU (None: it can). Under the
    AVX2 cap an AMX CPU's bf16 engines abort on their first step: vLLM packs
    small bf16 weights for AMX by CPUID, and torch's brgemm refuses them
    under oneDNN's cap ("BFloat16 Brgemm VNNI format is only supported ...")."""
    if regime == "avx2cap" and dtype == "bfloat16" and "amx_tile" in cpu_flags:
        return "vLLM's AMX bf16 kernels abort under ONEDNN_MAX_CPU_ISA=AVX2 on an AMX CPU"
    return None


def spawn(job: dict, regime: str, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    env.update(REGIMES[regime])
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    tag = f"{regime}_{job['dtype']}_{job['workload']}_{job['run']}"
    (work / f"{tag}.job.json").write_text(json.dumps(job))
    with open(work / f"{tag}.log", "w") as log:
        cmd = [sys.executable, str(REPO / "benchmarks" / "matrix_worker.py"), str(work / f"{tag}.job.json"),
               str(work / f"{tag}.out.json")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(("[matrix]", "[bench]")):
                print("    " + line, end="", flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"worker exited {proc.returncode}; see {work / f'{tag}.log'}")
    return json.loads((work / f"{tag}.out.json").read_text())


def summarize(cell: dict) -> dict:
    """Per row, over the cell's pooled runs: figures, ratio and interval, integrity, verdict."""
    from bench_dspark import bootstrap_median_interval

    runs, out = cell["runs"], {}
    for label in row_labels(runs):
        got = [run["rows"][label] for run in runs if label in run["rows"]]
        rounds = [rd for row in got for rd in row["rounds"]]
        fig = {a: statistics.median(rd[a] for rd in rounds) for a in rounds[0]}
        ident = [i for run in runs for i in run["identity"].values()]
        ok = (all(i["ok"] for row in got for i in row["integrity"].values()) and all(i["lengths_ok"] for i in ident)
              and (cell["dtype"] != "float32" or all(i["identical"] == i["compared"] for i in ident if i["compared"])))
        row = {"figures": fig, "runs": len(got), "integrity_ok": ok,
               "identical": [sum(i["identical"] or 0 for i in ident), sum(i["compared"] for i in ident)]}
        if AD in fig and len(fig) > 1:
            best = max((a for a in fig if a != AD), key=fig.get)
            pairs = [p for r in got for p in (r.get("pairs") or [])]
            ratios = pairs or cross_fitted_ratios([row["rounds"] for row in got])
            if not pairs:  # beside it, the ratio against the arm best in the same rounds (biased low)
                row["ratio_in_sample"] = statistics.median(rd[AD] / rd[best] for rd in rounds)
            ratio, (lo, hi) = statistics.median(ratios), bootstrap_median_interval(ratios)
            verdict = "OK" if ratio >= LINE else "MISS"
            if lo < LINE <= hi:
                verdict += ", interval straddles 0.98"
            if abs(ratio / LINE - 1) < 0.05 and len(got) < 3:
                verdict += ", within 5%: wants >= 3 runs"
            row.update(best_other=best, ratio=ratio, interval90=[lo, hi], ratio_n=len(ratios),
                       ratio_source="head to head" if pairs else (
                           "per round, each run against the arm best in the other runs" if len(got) > 1
                           else "per round, against the arm best in the same rounds"))
            if K7 in fig and NS in fig and fig[K7] < fig[NS]:
                row["vs_k7"] = fig[AD] / fig[K7]
                verdict += f"; vs K=7 {'OK' if row['vs_k7'] >= K7_LINE else 'MISS'}"
            row["verdict"] = verdict
        out[label] = row
    return out


def cross_fitted_ratios(runs: list[list[dict]]) -> list[float]:
    """Adaptive over the best other arm, per round, each run's rounds against
    the arm best in the other runs' rounds (one run: in its own). Chosen in
    the same rounds, the best of three noisy arms is the luckiest: with this
    machine's 10% round-to-round spread in light Poisson, four equal arms give
    adaptive about 0.94x "the best other" over two rounds, 0.96x over six."""
    out = []
    for i, rounds in enumerate(runs):
        others = [rd for j, run in enumerate(runs) if j != i for rd in run] or rounds
        arms = [a for a in others[0] if a != AD]
        best = max(arms, key=lambda a: statistics.median(rd[a] for rd in others))
        out += [rd[AD] / rd[best] for rd in rounds]
    return out


ARM_TITLES = {"nospec": "no-spec", "dspark-k7": "full K=7", "dspark-k3": "full K=3", "dspark-adaptive": "adaptive"}


def matrix_table(record: dict) -> str:
    """The matrix as a markdown table: a row per cell row, the arms' figures, the ratio."""
    lines = ["| cell | row | " + " | ".join(ARM_TITLES.values()) + " | adaptive / best other (90%) "
             "| adaptive / K=7 | runs | commit | integrity | verdict |", "|---" * (len(ARM_TITLES) + 8) + "|"]
    for key in sorted(record.get("cells", {})):
        for label, row in (record["cells"][key].get("summary") or {}).items():
            figs = " | ".join(f"{row['figures'][a]:,.0f}" if a in row["figures"] else "–" for a in ARM_TITLES)
            ratio = (f"{row['ratio']:.3f} vs {ARM_TITLES[row['best_other']]} ({row['interval90'][0]:.2f}–"
                     f"{row['interval90'][1]:.2f})") if "ratio" in row else "–"
            k7 = f"{row['vs_k7']:.2f}" if "vs_k7" in row else "–"
            same = "identical {}/{}".format(*row["identical"])
            commits = ",".join(sorted({r["provenance"]["commit"] for r in record["cells"][key].get("runs", [])}))
            lines.append(f"| {key} | {label} | {figs} | {ratio} | {k7} | {row['runs']} | {commits} | "
                         f"{'ok' if row['integrity_ok'] else 'NOT OK'} ({same}) | {row.get('verdict', '–')} |")
    return "\n".join(lines)


SUMMARY_COLUMNS = (("waves", "c=1"), ("waves", "c=4"), ("waves", "c=16"), ("waves", "c=64"), ("poisson-light", None),
                   ("poisson-heavy", None), ("soak", None), ("soak-tokens", None))


def _cpu_tag(cell: dict) -> str:
    """The CPU of a cell's runs: model name and family/model where recorded."""
    for run in cell.get("runs", []):
        m = run["provenance"].get("machine") or {}
        if m.get("cpu_id"):
            family, model = m["cpu_id"].split()[1], m["cpu_id"].split()[3]
            return f"{m['cpu']} ({family}/{model})"
    return ""


def summary_table(record: dict) -> str:
    """One line per regime and dtype: adaptive / best other arm per cell row, a miss marked (the
    README's; matrix_table has every figure)."""
    heads = [w if lab is None else f"{w} {lab}" for w, lab in SUMMARY_COLUMNS]
    lines = ["| regime / dtype | CPU | " + " | ".join(heads) + " | rows at the line |", "|---" * (len(heads) + 3) + "|"]
    cells = record.get("cells", {})
    for regime, dtype in sorted({tuple(k.split("/")[:2]) for k in cells}):
        got, met, cpu = [], 0, ""
        for workload, label in SUMMARY_COLUMNS:
            cell = cells.get(f"{regime}/{dtype}/{workload}") or {}
            rows = cell.get("summary") or {}
            row = rows.get(label) if label else next(iter(rows.values()), None)
            cpu = cpu or _cpu_tag(cell)
            if not row or "ratio" not in row:
                got.append("–")
                continue
            ok = row["ratio"] >= LINE and (row.get("vs_k7") is None or row["vs_k7"] >= K7_LINE)
            met += ok
            got.append(f"{row['ratio']:.3f}" if ok else f"**{row['ratio']:.3f}**")
        shown = sum(g != "–" for g in got)
        lines.append(f"| {regime} / {DT_SHORT[dtype]} | {cpu} | " + " | ".join(got) + f" | {met} of {shown} |")
    return "\n".join(lines)


def row_line(row: dict) -> str:
    out = ", ".join(f"{a} {v:.1f}" for a, v in row["figures"].items())
    if "ratio" in row:
        lo, hi = row["interval90"]
        out += f"; adaptive / {row['best_other']} {row['ratio']:.3f} ({lo:.2f}-{hi:.2f}) {row['verdict']}"
    same = "identical {}/{}".format(*row["identical"])
    return out + f"; integrity {'ok' if row['integrity_ok'] else 'NOT OK'} ({same})"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = record.get("cells", {})
    shown = [w for w in WORKLOADS if any(c["workload"] == w for c in cells.values())] or ["waves"]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    for ax, workload in zip(axes[0], shown):
        bars = [(f"{c['regime']}\n{DT_SHORT[c['dtype']]}\n{label}", row) for k, c in sorted(cells.items())
                if c["workload"] == workload for label, row in (c.get("summary") or {}).items() if "ratio" in row]
        for i, (_, row) in enumerate(bars):
            lo, hi = row["interval90"]
            ax.bar(i, row["ratio"], color="tab:green" if row["ratio"] >= LINE else "tab:red", alpha=0.7)
            ax.errorbar(i, row["ratio"], yerr=[[row["ratio"] - lo], [hi - row["ratio"]]], color="black", capsize=3)
        ax.axhline(LINE, color="red", linestyle="--", linewidth=1, label="target 0.98")
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
        ax.set_ylim(bottom=min([0.8] + [r["interval90"][0] - 0.05 for _, r in bars]))
        ax.set_title(f"{workload}: adaptive / best other arm", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = record.get("machine") or {}
    fig.suptitle(f"{m.get('cpu')} x{m.get('cores')}: bars 90% bootstrap intervals, pooled runs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def in_repo(path: str) -> str:
    """A model path as the record keeps it: relative to the checkout where it lies inside one, so
    runs from another worktree of the repository pool with these."""
    full = Path(path).resolve()
    return str(full.relative_to(REPO)) if full.is_relative_to(REPO) else str(full)


def row_labels(runs: list[dict]) -> list[str]:
    """Every row of the runs, waves' in order of concurrency."""
    labels = list(dict.fromkeys(label for run in runs for label in run["rows"]))
    if all(label.startswith("c=") and label[2:].isdigit() for label in labels):
        labels.sort(key=lambda label: int(label[2:]))
    return labels


def kept_runs(cell: dict | None, want: dict, workload: str, fresh: bool) -> tuple[list[dict], int]:
    """The cell's runs that pool with runs of the settings ``want``, and how
    many of them count toward --runs. Waves pool per concurrency (their
    settings but the concurrencies match): every run counts for each c asked
    for that it has a row of, and --fresh drops only those rows."""
    if not cell or unpooled(cell, want, workload):
        return [], 0
    waves = workload == "waves"
    runs = cell["runs"]
    if not waves:
        return ([], 0) if fresh else (runs, len(runs))
    asked = [f"c={c}" for c in want["concurrency"]]
    if fresh:
        runs = [{**run, "rows": {k: v for k, v in run["rows"].items() if k not in asked}} for run in runs]
        runs = [run for run in runs if run["rows"]]
    return runs, min(sum(label in run["rows"] for run in runs) for label in asked)


def unpooled(cell: dict | None, want: dict, workload: str) -> list[str]:
    """The settings in which a cell's runs differ from ``want`` (none: they pool, or there are none)."""
    if not (cell and cell.get("runs")):
        return []
    have = cell.get("settings") or {}
    return sorted(k for k in set(have) | set(want) if not (workload == "waves" and k == "concurrency")
                  and (k not in have or k not in want or have[k] != want[k]))


def settings(args, workload: str) -> dict:
    """What a cell's runs must share to be pooled."""
    base = {"arms": args.arms, "target": in_repo(args.target), "drafter": in_repo(args.drafter),
            "identity": args.identity_prompts}
    if workload == "waves":
        # Settled pairs (measure_head_to_head, 363b0bc) do not pool with the plain ABBA pairs before them.
        return {**base, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
                "pairs": args.pairs, "pairs_settled": True}
    if workload.startswith("soak"):
        return {**base, "max_tokens": args.max_tokens, "soak_requests": args.soak_requests,
                "soak_kv_tokens": args.soak_kv_tokens, "soak_rounds": args.soak_rounds}
    return {**base, "concurrency": args.concurrency, "serve_prompts": args.serve_prompts,
            "serve_tokens": args.serve_tokens, "serve_rounds": args.serve_rounds, "rates": args.rates}


def serve_rate(args, record: dict, regime: str, dtype: str, heavy: bool) -> tuple[float, str]:
    if args.rates:
        return args.rates[heavy], "fixed (--rates)"
    c, share = ("c=16", HEAVY_SHARE) if heavy else ("c=1", LIGHT_SHARE)
    waves = (record["cells"].get(f"{regime}/{dtype}/waves") or {}).get("summary") or {}
    tps = (waves.get(c) or {}).get("figures", {}).get(NS)
    if tps:
        return share * tps / args.serve_tokens, (f"{share} x no-spec waves {c} ({tps:.0f} tok/s) / "
                                                  f"{args.serve_tokens} tokens")
    return FIXED_RATES[heavy], f"fixed default (no no-spec waves {c} of {regime}/{dtype} in the record)"


def estimate_s(args, regime: str, workload: str) -> float:
    """One run of a cell, by --dry-run's rough cost model (EST, EST_TOKS)."""
    arms, slow = len(args.arms), EST_AVX2 if regime in ("avx2cap", "avx2") else 1.0
    if workload == "waves":
        work = sum((args.rounds * arms + 2 * args.pairs) * c * max(2, 4 // c) * args.max_tokens / EST_TOKS.get(c, 1500)
                   for c in args.concurrency)
        return EST["worker"] + arms * EST["engine"] + slow * work
    if workload.startswith("soak"):
        tokens = args.soak_requests * 7 * args.max_tokens / 12
        return EST["worker"] + arms * EST["engine"] + slow * args.soak_rounds * arms * tokens / EST_TOKS[SOAK_C]
    heavy = workload == "poisson-heavy"
    n = args.serve_prompts[heavy]
    guess = (HEAVY_SHARE * EST_TOKS[16] if heavy else LIGHT_SHARE * EST_TOKS[1]) / args.serve_tokens
    rate = args.rates[heavy] if args.rates else guess
    one = EST["client"] + max(n / rate, slow * n * args.serve_tokens / EST_TOKS[16])
    return EST["worker"] + arms * EST["server"] + args.serve_rounds * arms * one


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    from vllm_dspark.benchmarking import (LATEST, TINY_DRAFTER, TINY_TARGET, archive, head_commit, record_commit,
                                          write_record)
    from vllm_dspark.fingerprint import machine_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--runs", type=int, default=1, help="runs a cell pools (a fresh subprocess each)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens a request (waves; soak's longest)")
    ap.add_argument("--rounds", type=int, default=5, help="waves: interleaved rounds a concurrency")
    ap.add_argument("--pairs", type=int, default=10, help="waves: head-to-head ABBA pairs a concurrency (0: none)")
    ap.add_argument("--serve-prompts", type=int, nargs=2, default=[48, 192], metavar=("LIGHT", "HEAVY"))
    ap.add_argument("--serve-tokens", type=int, default=64)
    ap.add_argument("--serve-rounds", type=int, default=2)
    ap.add_argument("--rates", type=float, nargs=2, default=None, metavar=("LIGHT", "HEAVY"),
                    help="fixed request rates (req/s) instead of ones from no-spec's waves")
    ap.add_argument("--soak-requests", type=int, default=96)
    ap.add_argument("--soak-kv-tokens", type=int, default=1536, help="soak KV cache, in tokens of the target's KV")
    ap.add_argument("--soak-rounds", type=int, default=2)
    ap.add_argument("--identity-prompts", type=int, default=4)
    ap.add_argument("--target", default=str(REPO / TINY_TARGET))
    ap.add_argument("--drafter", default=str(REPO / TINY_DRAFTER))
    ap.add_argument("--out", type=Path, default=LATEST / "matrix.json")
    ap.add_argument("--fresh", action="store_true", help="rerun the cells asked for, dropping their runs")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time only")
    args = ap.parse_args(argv)

    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    record.setdefault("cells", {})
    plan, machine = [], machine_info()
    for regime in args.regimes:
        label = regime_label(regime, machine["cpu_flags"])
        if label is None:
            print(f"[matrix] {regime}: skipped, this CPU ({machine['cpu']}) has no AVX-512: native is that regime")
            continue
        for dtype in args.dtypes:
            if blocked := regime_blocked(regime, dtype, machine["cpu_flags"]):
                print(f"[matrix] {regime}/{dtype}: skipped, {blocked}")
                continue
            for workload in args.workloads:
                key, want = f"{label}/{dtype}/{workload}", settings(args, workload)
                kept, have = kept_runs(record["cells"].get(key), want, workload, args.fresh)
                if not kept and (differ := unpooled(record["cells"].get(key), want, workload)):
                    print(f"[matrix] {key}: its runs were taken at other settings ({', '.join(differ)}) and do not "
                          f"pool: the runs to do replace all of them, every concurrency")
                if workload == "waves" and kept:  # the cell's settings name every concurrency it holds
                    held = {int(label[2:]) for run in kept for label in run["rows"]}
                    want = {**want, "concurrency": sorted(held | set(args.concurrency))}
                plan.append((key, regime, label, dtype, workload, want, have, max(0, args.runs - have), kept))
    total = sum(p[7] * estimate_s(args, p[2], p[4]) for p in plan)
    for key, _, label, _, workload, _, have, todo, _ in plan:
        print(f"[matrix] plan {key}: {todo} run(s) to do ({have} pooled), "
              f"~{estimate_s(args, label, workload) / 60:.1f} min a run")
    print(f"[matrix] estimated total {total / 60:.0f} min ({total / 3600:.1f} h) for {sum(p[7] for p in plan)} runs")
    if args.dry_run:
        return record
    if args.out.exists() and args.out.parent.resolve() == LATEST.resolve():
        old = record_commit(args.out, record.get("checkpoint_of"))
        if old != head_commit():
            archive(args.out)  # another commit's record goes to history/; its cells stay in the merge
    work, t_all = Path(tempfile.mkdtemp(prefix="dspark_matrix_")), time.time()
    print(f"[matrix] logs in {work}", flush=True)
    for n, (key, regime, label, dtype, workload, want, have, todo, kept) in enumerate(plan, 1):
        if not todo:
            print(f"[matrix] {key}: {have} run(s) of these settings already in the record, skipped")
            continue
        cell = {"regime": label, "cpu": machine["cpu"], "dtype": dtype, "workload": workload,
                "unit": UNITS[workload], "settings": want,
                "runs": list(kept)}
        for i in range(todo):
            job = {**want, "target": args.target, "drafter": args.drafter, "workload": workload, "dtype": dtype,
                   "run": have + i, "argv": ["bench_matrix.py", *argv],
                   "serve_tokens": args.serve_tokens, "serve_prompts": args.serve_prompts,
                   "serve_rounds": args.serve_rounds, "concurrency": args.concurrency}
            if workload.startswith("poisson"):
                job["rate"], cell["rate_source"] = serve_rate(args, record, label, dtype, workload.endswith("heavy"))
                print(f"[matrix] {key}: {job['rate']:.2f} req/s, {cell['rate_source']}", flush=True)
            t0 = time.time()
            print(f"[matrix] {key} run {have + i + 1}/{have + todo} (cell {n} of {len(plan)})", flush=True)
            try:
                cell["runs"].append(spawn(job, regime, work))
            except RuntimeError as err:
                print(f"[matrix] {key} run {have + i + 1} FAILED: {err}", flush=True)
                continue
            cell["summary"] = summarize(cell)
            record["cells"][key], record["checkpoint_of"] = cell, head_commit()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=2) + "\n")  # checkpoint: a crash keeps the cells done
            print(f"[matrix] {key} run done in {time.time() - t0:.0f} s (elapsed {(time.time() - t_all) / 60:.1f} min)")
            for row_label, row in cell["summary"].items():  # not label: the next run's rate reads it
                print(f"[matrix] {key} {row_label}: {row_line(row)}", flush=True)
    record.update(benchmark="matrix", machine=machine, target=args.target, drafter=args.drafter,
                  command=" ".join(["python", "benchmarks/bench_matrix.py", *argv]),
                  note="each cell's runs carry their own provenance (commit, env, CPU, engine dtype and KV "
                  "bytes); the provenance file beside this record is of the last invocation only")
    if record["cells"]:
        args.out.unlink(missing_ok=True)  # this invocation's checkpoint (or same-commit record, merged above)
        write_record(record, args.out, plot, "matrix", ["bench_matrix.py", *argv])
        print(matrix_table(record))
        print(summary_table(record))
    return record


if __name__ == "__main__":
    main()
