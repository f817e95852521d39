"""Two engines at tensor_parallel_size=2 (no-spec, then DSpark adaptive),
greedy, float32; prints one JSON line. Run by test_tensor_parallel.py in its
own process with VLLM_CPU_OMP_THREADS_BIND="0|1" and
VLLM_DSPARK_TEST_CLOCK_SKEW_S set, so rank 1's step clock disagrees with
rank 0's. Without rank 0's timings shared (rank_sync.py) the DSpark engine
hangs here (checked by hand: share=None in the runner, killed after 200 s)."""

import json
import os
import sys

PROMPTS, TOKENS, SEQS = 12, 48, 4


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.conftest import TARGET_DIR
    from tests.e2e.conftest import TEST_DTYPE, dspark_config, greedy_params
    from vllm_dspark.benchmarking import start_engine, stop_engine
    from vllm_dspark.training.prompts import load_prompts

    prompts = [p["text"] for p in load_prompts()[:PROMPTS]]
    out = {}
    for name, spec in (("nospec", None), ("dspark", dspark_config(7))):
        llm = start_engine(str(TARGET_DIR), max_num_seqs=SEQS, dtype=TEST_DTYPE, spec=spec, tensor_parallel_size=2,
                           distributed_executor_backend="mp", kv_cache_memory_bytes=64 << 20)
        try:
            outs = llm.generate(prompts, greedy_params(TOKENS), use_tqdm=False)
            out[name] = [list(o.outputs[0].token_ids) for o in outs]
            if spec is not None:
                out["snapshots"] = llm.collective_rpc("dspark_snapshot")
        finally:
            stop_engine(llm)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
