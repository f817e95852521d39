"""One DSpark engine whose drafter is a Hugging Face hub id, served from the
cache named by HF_HUB_CACHE with HF_HUB_OFFLINE=1 (both must be set before
huggingface_hub is imported, hence its own process: test_layouts.py runs it).
policy "full", greedy, float32; prints one JSON line."""

import json
import os
import sys


def main(hub_id: str, prompts: int, tokens: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.conftest import TARGET_DIR
    from tests.e2e.conftest import TEST_DTYPE, greedy_params
    from vllm_dspark.benchmarking import spec_counters, start_engine, stop_engine
    from vllm_dspark.training.prompts import load_prompts

    texts = [p["text"] for p in load_prompts()[:prompts]]
    spec = {"method": "dspark", "model": hub_id, "num_speculative_tokens": 7}
    llm = start_engine(str(TARGET_DIR), max_num_seqs=16, dtype=TEST_DTYPE, spec=spec, knobs={"policy": "full"})
    try:
        outs = llm.generate(texts, greedy_params(tokens), use_tqdm=False)
        result = {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "counters": spec_counters(llm),
                  "drafter_path": llm.llm_engine.vllm_config.speculative_config.draft_model_config.model}
    finally:
        stop_engine(llm)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
