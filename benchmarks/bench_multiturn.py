"""Multi-turn chat through `vllm serve`: time to first token and prefix-cache
hits, no-spec against DSpark (default adaptive controller).

    python benchmarks/bench_multiturn.py                 # 16 conversations x 4 turns, ~5 min
    python benchmarks/bench_multiturn.py --conversations 8 --turns 3

Each turn of each conversation sends its whole history (earlier user
messages and the replies the server gave) plus a new user message, streamed,
greedy, --reply-tokens tokens; the conversations of a turn run concurrently.
The servers run one after the other (never both busy), with this CPU's dtype
and a KV cache that holds every conversation. Reported per arm and turn:
TTFT (client side, request sent to first streamed token: median, p90), the
prefix-cache hit rate (vLLM's own counters), completions and their lengths,
and whether the final conversations are identical across arms. JSON + PNG.
"""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def turn_request(base: str, model: str, prompt: str, tokens: int) -> tuple[float, str, int]:
    """(seconds to the first streamed token, the reply, its token count)."""
    import requests

    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, count = time.perf_counter(), None, [], 0
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(choice["text"])
    return ttft, "".join(text), count


def run_arm(base: str, model: str, openings: list[list[str]], tokens: int) -> dict:
    from vllm_dspark.benchmarking import server_metric

    histories = ["" for _ in openings]
    turns = []
    for t in range(len(openings[0])):
        q0, h0 = server_metric(base, "vllm:prefix_cache_queries_total"), server_metric(base, "vllm:prefix_cache_hits_total")
        prompts = [h + f"\nUser: {conv[t]}\nAssistant:" for h, conv in zip(histories, openings)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: turn_request(base, model, p, tokens), prompts))
        histories = [p + reply for p, (_, reply, _) in zip(prompts, results)]
        queries = server_metric(base, "vllm:prefix_cache_queries_total") - q0
        hits = server_metric(base, "vllm:prefix_cache_hits_total") - h0
        ttfts = sorted(r[0] for r in results)
        turns.append({"turn": t + 1, "ttft_median_s": statistics.median(ttfts),
                      "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))], "prefix_queries": queries,
                      "prefix_hits": hits, "hit_rate": hits / queries if queries else 0.0,
                      "completed": len(results), "lengths_ok": all(r[2] == tokens for r in results)})
        print(f"[multiturn] turn {t + 1}: TTFT median {turns[-1]['ttft_median_s'] * 1000:.0f} ms, "
              f"hit rate {turns[-1]['hit_rate']:.2f}", flush=True)
    return {"turns": turns, "histories": histories}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, arm in record["arms"].items():
        turns = [t["turn"] for t in arm["turns"]]
        a.plot(turns, [1000 * t["ttft_median_s"] for t in arm["turns"]], marker="o", label=name)
        b.plot(turns, [t["hit_rate"] for t in arm["turns"]], marker="o", label=name)
    a.set_xlabel("turn")
    a.set_ylabel("median TTFT (ms)")
    b.set_xlabel("turn")
    b.set_ylabel("prefix-cache hit rate")
    a.legend()
    b.legend()
    m = record["machine"]
    fig.suptitle(f"{record['conversations']} conversations, {m['cpu']} x{m['cores']}, {record['dtype']}, "
                 f"commit {record['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest" / "multiturn.json")
    args = ap.parse_args(argv)

    import os
    import tempfile

    from vllm_dspark.benchmarking import (KV_CACHE_BYTES, TINY_DRAFTER, TINY_TARGET, head_commit, start_server,
                                          stop_server, write_record)
    from vllm_dspark.fingerprint import cpu_dtype, machine_info
    from vllm_dspark.training.prompts import load_prompts

    machine = machine_info()
    dtype = cpu_dtype(machine["cpu_flags"])
    texts = [p["text"] for p in load_prompts()]
    openings = [texts[i * args.turns:(i + 1) * args.turns] for i in range(args.conversations)]
    target = str(REPO / TINY_TARGET)
    spec = {"method": "dspark", "model": str(REPO / TINY_DRAFTER), "num_speculative_tokens": 7}
    work = Path(tempfile.mkdtemp(prefix="dspark_multiturn_"))
    arms = {}
    for name, extra in (("no-spec", []), ("dspark", ["--speculative-config", json.dumps(spec)])):
        print(f"[multiturn] starting {name}", flush=True)
        env = {**os.environ, "VLLM_DSPARK_CACHE_DIR": str(work / "costs")}
        server = start_server(target, ["--dtype", dtype, "--max-model-len", "2048", "--max-num-seqs",
                                       str(args.conversations), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                                       "--enforce-eager", "--seed", "0", *extra], work / f"{name}.log", env)
        try:
            arms[name] = run_arm(server[1], target, openings, args.reply_tokens)
        finally:
            stop_server(server)
    same = sum(a == b for a, b in zip(arms["no-spec"].pop("histories"), arms["dspark"].pop("histories")))
    record = {"command": "python " + " ".join([Path(__file__).relative_to(REPO).as_posix(), *sys.argv[1:]]),
              "machine": machine, "commit": head_commit(), "dtype": dtype, "conversations": args.conversations,
              "turns": args.turns, "reply_tokens": args.reply_tokens, "arms": arms,
              "identical_conversations": f"{same}/{args.conversations}"}
    write_record(record, args.out, plot, "multiturn")
    return record


if __name__ == "__main__":
    main()
