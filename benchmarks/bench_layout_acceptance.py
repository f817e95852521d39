"""What K below the block and a reduced draft vocabulary cost in acceptance.

    python benchmarks/bench_layout_acceptance.py              # ~8 min on 2 cores
    python benchmarks/bench_layout_acceptance.py --prompts 32 --ks 3 7 --vocabs 1024

One engine per arm, greedy, float32, policy "full" (every drafted token is
verified, so the counters measure the drafter alone): the native drafter at
num_speculative_tokens K (a K-position block [anchor, mask x (K-1)] where it
was trained on 7), and at K=7 converted to a reduced draft vocabulary of the N
ids most frequent in its training text (convert.py). Reports tau (tokens per
verification, bonus included), per-position acceptance, greedy identity to
the no-spec engine of the same run, and completion counts. JSON and a PNG.
"""

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def per_position(llm) -> list[float]:
    """vLLM's accepted-tokens-per-position counter over its draft count."""
    drafts, per_pos = 0.0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = list(m.values)
    return [v / drafts for v in per_pos] if drafts else []


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    arms = record["arms"]
    a.bar([r["arm"] for r in arms], [r["tau"] for r in arms], color="tab:blue")
    a.set_ylabel("tau (tokens per verification)")
    a.set_title("acceptance by arm (greedy, policy full)")
    a.tick_params(axis="x", rotation=30)
    for r in arms:
        b.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o", label=r["arm"])
    b.set_xlabel("draft position")
    b.set_ylabel("share of blocks accepted through it")
    b.legend(fontsize=8)
    fig.suptitle(f"{record['machine']['cpu']} x{record['machine']['cores']}, commit {record.get('commit', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5, 7])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "layout_acceptance.json")
    args = ap.parse_args(argv)

    from vllm import SamplingParams

    from vllm_dspark.benchmarking import (TINY_DRAFTER, TINY_TARGET, head_commit, spec_counters, start_engine,
                                          stop_engine, write_record)
    from vllm_dspark.convert import convert
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    work = Path(tempfile.mkdtemp(prefix="dspark_layouts_"))
    arms = [("no-spec", None, None)] + [(f"K={k}", str(REPO / TINY_DRAFTER), k) for k in args.ks]
    for n in args.vocabs:
        folder = convert(str(REPO / TINY_DRAFTER), str(work / f"vocab{n}"), "speculators", draft_vocab=n)
        arms.append((f"K=7, vocab {n}", str(folder), 7))
    rows, reference, nospec = [], None, None
    for i, (label, drafter, k) in enumerate(arms, 1):
        print(f"[layouts] {i}/{len(arms)} {label}", flush=True)
        spec = None if drafter is None else {"method": "dspark", "model": drafter, "num_speculative_tokens": k}
        llm = start_engine(str(REPO / TINY_TARGET), 16, spec, {"policy": "full"} if spec else None, dtype="float32")
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            row = {"arm": label, "k": k, "completed": len(outs),
                   "output_tokens": sum(len(t) for t in ids)}
            if reference is None:
                reference, nospec = ids, row
            else:
                c = spec_counters(llm)
                row.update(tau=1 + c["num_accepted_tokens"] / c["num_drafts"], per_position=per_position(llm),
                           greedy_identical=f"{sum(a == b for a, b in zip(ids, reference))}/{len(ids)}")
                print(f"[layouts] {label}: tau {row['tau']:.3f}, identical {row['greedy_identical']}", flush=True)
                rows.append(row)
        finally:
            stop_engine(llm)
    record = {"command": "python " + " ".join([Path(__file__).relative_to(REPO).as_posix(), *sys.argv[1:]]),
              "machine": machine_info(), "commit": head_commit(), "prompts": len(prompts),
              "max_tokens": args.max_tokens, "dtype": "float32", "policy": "full", "nospec": nospec, "arms": rows}
    write_record(record, args.out, plot, "layouts")
    return record


if __name__ == "__main__":
    main()
