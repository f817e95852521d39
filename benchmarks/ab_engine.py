"""One engine of bench_ab.py, serving measurement commands on stdin.

    python benchmarks/ab_engine.py PLUGIN_ROOT CONFIG_JSON

PLUGIN_ROOT is the folder holding the ``vllm_dspark`` package to load (it is
put first on PYTHONPATH by the driver, for the engine's own processes too).
Replies are single lines on stdout starting with ``@@ab `` (vLLM's log lines
go to the same stream and are ignored by the driver).
"""

import json
import os
import sys
import time
from pathlib import Path


def reply(**fields) -> None:
    print("@@ab " + json.dumps(fields), flush=True)


def main() -> None:
    root, config = Path(sys.argv[1]), json.loads(sys.argv[2])
    sys.path.insert(0, str(root))
    import vllm_dspark
    from vllm_dspark.benchmarking import measure_offline, start_engine, stop_engine

    prompts = [json.loads(line)["text"] for line in Path(config["prompts"]).read_text().splitlines() if line.strip()]
    llm = start_engine(config["target"], config["max_num_seqs"], spec=config["spec"], knobs=config.get("knobs"),
                       dtype=config.get("dtype", "bfloat16"))
    measure_offline(llm, prompts[:4], 4, 16)  # warm-up
    reply(ready=True, plugin=vllm_dspark.__file__)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "round":
            c, n = cmd["concurrency"], cmd["requests"]
            sample = measure_offline(llm, prompts[:n], c, cmd["max_tokens"])
            reply(tokens_per_s=sample.tokens_per_s, output_tokens=sample.output_tokens, seconds=sample.seconds)
        elif cmd["op"] == "outputs":
            from vllm import SamplingParams

            params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
            outs = llm.generate(prompts[: cmd["requests"]], params, use_tqdm=False)
            reply(token_ids=[list(o.outputs[0].token_ids) for o in outs])
        elif cmd["op"] == "snapshot":
            reply(snapshot=llm.collective_rpc("dspark_snapshot")[0])
        else:
            break
    t0 = time.time()
    stop_engine(llm)
    reply(stopped=round(time.time() - t0, 1))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
