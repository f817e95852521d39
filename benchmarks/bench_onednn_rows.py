"""vLLM's CPU linear keeps 32 oneDNN primitives per weight shape: what a
verify step's varying token count costs once it has more than 32 values.

    python benchmarks/bench_onednn_rows.py          # ~1 min, CPU only

Without AMX, vLLM's CPU build runs an unquantized linear layer through
`onednn_mm`: a handler per layer, whose oneDNN primitives sit in a cache of
32 entries per weight shape, keyed by the number of rows and shared by every
layer of that shape in the process (a drafter with the target's shapes
shares it too). Adaptive verify lengths give a step a token count that
varies from step to step; full K=7 gives one count per batch size. This
times vLLM's own op on the tiny target's four weight shapes (qkv, o,
gate_up, down; four layers: one forward's linears), with the rows drawn at
random from all values of a range or from 16 of them (the same mean), 500
forwards each after 100 to warm up, per dtype. Writes JSON and a PNG.
"""

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = [(256, 512), (256, 256), (256, 1408), (704, 256)]  # (in, out) of the tiny target's linears
LAYERS = 4
RANGES = [(4, 32), (16, 128), (64, 512)]  # verify tokens at c = 4, 16, 64 (1 to 8 a request)


def measure(dtype_name: str, lo: int, hi: int, forwards: int, seed: int = 0) -> dict:
    import torch
    from vllm import _custom_ops as ops

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    torch.manual_seed(seed)
    handlers = [ops.create_onednn_mm(torch.randn(n, k, dtype=dtype).t(), 32) for k, n in SHAPES]
    values = list(range(lo, hi + 1))
    inputs = {m: [torch.randn(m, k, dtype=dtype) for k, _ in SHAPES] for m in values}

    def forward(m: int) -> float:
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            for h, x in zip(handlers, inputs[m]):
                ops.onednn_mm(h, x, None)
        return time.perf_counter() - t0

    rng = random.Random(seed)
    out = {}
    spread = sorted({values[round(i * (len(values) - 1) / 15)] for i in range(16)})  # 16, evenly, ends kept
    for name, pool in (("16 values", spread), ("all values", values)):
        rows = [rng.choice(pool) for _ in range(forwards + 100)]
        for m in rows[:100]:
            forward(m)
        times = [forward(m) for m in rows[100:]]
        out[name] = {"values": len(pool), "mean_rows": sum(rows[100:]) / forwards,
                     "mean_ms": 1e3 * sum(times) / forwards}
    out["ratio"] = out["all values"]["mean_ms"] / out["16 values"]["mean_ms"]
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.35
    for i, dt in enumerate(record["dtypes"]):
        rows = record["results"][dt]
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        ax.bar(xs, [r["ratio"] for r in rows], width, label=dt)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(RANGES)))
    ax.set_xticklabels([f"rows {lo}-{hi}" for lo, hi in RANGES])
    ax.set_ylabel("forward time, all values / 16 values")
    ax.set_title(f"vLLM onednn_mm, 32-entry row cache ({record['machine'].get('cpu', '?')})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forwards", type=int, default=500)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "onednn_rows.json")
    args = ap.parse_args(argv)

    from vllm_dspark.benchmarking import write_record
    from vllm_dspark.fingerprint import machine_info

    t0 = time.perf_counter()
    results = {}
    for dt in args.dtypes:
        results[dt] = []
        for lo, hi in RANGES:
            r = {"rows": [lo, hi], **measure(dt, lo, hi, args.forwards)}
            results[dt].append(r)
            print(f"[onednn] {dt:>8} rows {lo}-{hi}: {r['16 values']['mean_ms']:.3f} ms (16 values) "
                  f"-> {r['all values']['mean_ms']:.3f} ms ({r['all values']['values']} values), "
                  f"x{r['ratio']:.2f}", flush=True)
    record = {"command": " ".join(["python", "benchmarks/bench_onednn_rows.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "dtypes": args.dtypes, "shapes": SHAPES, "layers": LAYERS,
              "forwards": args.forwards, "results": results, "wall_seconds": round(time.perf_counter() - t0, 1)}
    write_record(record, args.out, plot, "onednn")
    return record


if __name__ == "__main__":
    main()
