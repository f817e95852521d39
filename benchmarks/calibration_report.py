"""Per-position calibration error of the confidence head, raw and after online
calibration, on held-out prompts, greedy and sampled.

    python benchmarks/calibration_report.py

One DSpark engine (policy "full", so every drafted position up to the first
rejection is observed) runs the held-out prompts at temperature 0 and at 1.
The controller scores every prediction before its outcome updates the
calibration (prequential), so "calibrated" is what the controller actually
used. Writes JSON and a PNG.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> dict:
    from vllm import SamplingParams

    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, start_engine, stop_engine
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "calibration.json")
    args = ap.parse_args(argv)
    prompts = [p["text"] for p in load_prompts(limit=args.prompts)]
    spec = {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7}
    llm = start_engine(str(REPO / TINY_TARGET), max_num_seqs=16, spec=spec,
                       knobs={"policy": "full", "persist_cost_model": False})
    try:
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)
        snap = llm.collective_rpc("dspark_snapshot")[0]
    finally:
        stop_engine(llm)
    record = {"command": "python benchmarks/calibration_report.py", "machine": machine_info(),
              "prompts": len(prompts), "max_tokens": args.max_tokens, "calibration": snap["calibration"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    plot(record, args.out.with_suffix(".png"))
    for mode, state in snap["calibration"].items():
        fmt = lambda xs: " ".join("  -  " if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"[calibration] {mode:>7} raw ECE        {fmt(state['ece_raw'])}")
        print(f"[calibration] {mode:>7} calibrated ECE {fmt(state['ece_calibrated'])}")
    return record


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = record["calibration"]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.5), squeeze=False)
    for ax, (mode, state) in zip(axes[0], modes.items()):
        k = len(state["ece_raw"])
        pos = list(range(1, k + 1))
        for kind, shift in (("raw", -0.2), ("calibrated", 0.2)):
            vals = [v if v is not None else 0 for v in state[f"ece_{kind}"]]
            ax.bar([p + shift for p in pos], vals, width=0.4, label=kind)
        ax.set_title(f"{mode} requests")
        ax.set_xlabel("draft position")
        ax.set_ylabel("ECE")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
