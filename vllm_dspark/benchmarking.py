"""Shared helpers for the demo and the benchmark scripts (offline LLM() runs)."""

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LATEST = RESULTS / "latest"  # the current run of each benchmark; earlier ones in history/<commit>/
# Environment variables that change what a run measures (an ISA cap, thread counts, the plugin's own).
PERF_ENV_PREFIXES = ("ONEDNN_", "DNNL_", "OMP_", "MKL_", "VLLM_CPU_", "VLLM_DSPARK_")


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


TINY_TARGET = "examples/models/tiny-qwen3"
TINY_DRAFTER = "examples/models/tiny-qwen3-dspark"
# Engine settings shared by the demo, the benchmarks and the e2e tests. The KV
# cache is sized in bytes: vLLM's CPU worker otherwise takes
# gpu_memory_utilization of NUMA node 0's memory less its own RSS, and node 0
# differs between machines of this kind (9.5 GiB of 24 on some), so the same
# fraction ran on one and failed to start on another. 256 MiB holds about
# 100k tokens of the tiny pair, far more than any run here keeps in flight.
KV_CACHE_BYTES = 256 << 20
ENGINE_DEFAULTS = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=KV_CACHE_BYTES,
                       enforce_eager=True, seed=0, disable_log_stats=False)


def start_engine(model: str, max_num_seqs: int, spec: dict | None = None,
                 knobs: dict | None = None, **overrides):
    """An offline LLM(); ``spec`` is a speculative_config, ``knobs`` the
    additional_config["dspark"] block."""
    from vllm import LLM

    from vllm_dspark.strays import warn_stray_engines

    warn_stray_engines()
    kw = {**ENGINE_DEFAULTS, "model": model, "max_num_seqs": max_num_seqs, **overrides}
    if spec is not None:
        kw["speculative_config"] = spec
    if knobs is not None:
        kw["additional_config"] = {"dspark": knobs}
    return LLM(**kw)


def stop_engine(llm) -> None:
    """Shut the engine's processes down now, so the next engine gets the cores."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def kv_capacity_tokens(llm) -> int:
    """Tokens the engine's KV cache holds (blocks x block size)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks or 0) * int(cache.block_size)


def spec_counters(llm) -> dict[str, float]:
    """vLLM's cumulative spec-decode counters (drafts, draft tokens, accepted)."""
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def mean_accepted_length(before: dict, after: dict) -> float | None:
    """Tokens committed per verification step, bonus included (tau)."""
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    if drafts <= 0:
        return None
    return 1 + (after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)) / drafts


def measure_arm(label: str, target: str, prompts: list[str], concurrencies: list[int],
                max_tokens: int, spec: dict | None = None, knobs: dict | None = None,
                **overrides) -> list[dict]:
    """Start one engine, measure tok/s (and tau with speculation) at each
    concurrency, stop it. A wave count keeps short runs from being all noise."""
    llm = start_engine(target, max_num_seqs=max(concurrencies), spec=spec, knobs=knobs, **overrides)
    try:
        measure_offline(llm, prompts[:4], 4, 16)  # warm-up
        rows = []
        for c in concurrencies:
            waves = max(4, 32 // c)
            before = spec_counters(llm)
            row = measure_offline(llm, prompts[: c * waves], c, max_tokens).as_dict()
            row["mean_accepted_length"] = mean_accepted_length(before, spec_counters(llm))
            if spec is not None:
                row["controller"] = llm.collective_rpc("dspark_snapshot")[0]
            rows.append(row)
            tau = row["mean_accepted_length"]
            print(f"[bench] {label:>17} c={c:<3} {row['tokens_per_s']:8.1f} tok/s"
                  + (f"  tau={tau:.2f}" if tau else ""), flush=True)
        return rows
    finally:
        stop_engine(llm)


def measure_interleaved(engines: dict, prompts: list[str], concurrencies: list[int],
                        max_tokens: int, rounds: int = 3) -> dict[str, list[dict]]:
    """Measure several live engines side by side: at each concurrency, in
    ``rounds`` rounds with the arm order rotated each round, so a slow spell
    of a shared machine hits every arm alike. An arm's figure is its median
    round (all rounds are kept in ``rounds_tokens_per_s``). Acceptance comes
    from each engine's own controller counters: vLLM's Prometheus registry is
    per process, shared by every engine in it."""
    names = list(engines)
    for llm in engines.values():
        measure_offline(llm, prompts[:4], 4, 16)  # warm-up
    out: dict[str, list[dict]] = {name: [] for name in names}
    for c in concurrencies:
        waves = max(2, 4 // c)  # short rounds, more of them: the machine drifts
        samples: dict[str, list[tuple[ThroughputSample, float | None]]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                llm = engines[name]
                before = _acceptance(llm)
                sample = measure_offline(llm, prompts[: c * waves], c, max_tokens)
                samples[name].append((sample, mean_accepted_length(before, _acceptance(llm))))
        for name in names:
            ranked = sorted(samples[name], key=lambda st: st[0].tokens_per_s)
            sample, tau = ranked[len(ranked) // 2]
            row = sample.as_dict()
            row["rounds_tokens_per_s"] = [st[0].tokens_per_s for st in samples[name]]
            row["mean_accepted_length"] = tau
            if engines[name].llm_engine.vllm_config.speculative_config is not None:
                row["controller"] = engines[name].collective_rpc("dspark_snapshot")[0]
            out[name].append(row)
            mape = row.get("controller", {}).get("cost_model_mape")
            print(f"[bench] {name:>17} c={c:<3} {row['tokens_per_s']:8.1f} tok/s (median of {rounds})"
                  + (f"  tau={tau:.2f}" if tau else "")
                  + (f"  step-time error {mape:.1f}%" if mape is not None else ""), flush=True)
    return out


def measure_head_to_head(first, second, prompts: list[str], concurrency: int, max_tokens: int,
                         pairs: int, settle: bool = True) -> list[tuple[float, float]]:
    """Two live engines, one round each back to back, ``pairs`` times, the
    order swapped every pair (ABBA: a steady drift favours neither). Returns
    (first's, second's) tok/s per pair. Two engines only, so each pair's
    rounds are seconds apart, not a whole sweep round: the per-pair ratio
    cancels more of a shared machine's drift than the sweep's rounds can.
    A round right after the other engine's is not measured: the engine runs
    it once unmeasured first. Any engine's first round after another's ran
    4-5% slow (caches; ``bench_order_effect.py``), and ABBA put that round on
    the second engine of every pair: two no-spec engines' pairs fell in two
    clusters 7% apart by order. ``settle`` False: every round measured (how
    bench_order_effect.py shows that)."""
    waves = max(2, 4 // concurrency)  # the sweep's round
    batch = prompts[: concurrency * waves]
    out, last = [], None
    for i in range(pairs):
        order = (first, second) if i % 2 == 0 else (second, first)
        rates = {}
        for llm in order:
            if settle and llm is not last:
                measure_offline(llm, batch, concurrency, max_tokens)  # settles after the other engine's round
            rates[id(llm)] = measure_offline(llm, batch, concurrency, max_tokens).tokens_per_s
            last = llm
        out.append((rates[id(first)], rates[id(second)]))
    return out


def take_turns(engines: list, batches: list[list[str]], params) -> tuple[list[list[float]], list[list]]:
    """Live engines generate each batch in turn, the order reversed every
    batch (ABBA), so the machine's spells fall on every engine alike (run one
    after the other, fresh engines measured the machine drifting over
    minutes: ``bench_engine_drift.py``). Returns, per engine, the seconds of
    each of its batches and its outputs."""
    seconds: list[list[float]] = [[] for _ in engines]
    outputs: list[list] = [[] for _ in engines]
    for b, batch in enumerate(batches):
        for e in (range(len(engines)) if b % 2 == 0 else reversed(range(len(engines)))):
            t0 = time.perf_counter()
            outputs[e] += engines[e].generate(batch, params, use_tqdm=False)
            seconds[e].append(time.perf_counter() - t0)
    return seconds, outputs


def write_record(record: dict, out, plot, tag: str, argv: list[str] | None = None) -> None:
    """A benchmark's JSON at ``out``, ``plot(record, path)``'s PNG and a
    provenance JSON (commit, argv, versions, CPU model and flags) next to it.
    A run already in ``latest/`` moves to ``history/<its commit>/`` first."""
    import json
    import sys

    out = Path(out)
    if out.parent.resolve() == LATEST.resolve():
        archive(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    plot(record, out.with_suffix(".png"))
    prov = provenance(sys.argv if argv is None else argv)
    _provenance_path(out).write_text(json.dumps(prov, indent=2) + "\n")
    print(f"[{tag}] wrote {out}, {out.with_suffix('.png').name} and its provenance (commit {prov['commit']})")


def provenance(argv: list[str], engine: bool = True) -> dict:
    """What produced a run: the commit (and whether the tree had changes), the
    command, the environment that changes it, the engine settings (dtype, KV
    bytes: ``engine``, the run started engines) and the machine."""
    from vllm_dspark.fingerprint import machine_info
    from vllm_dspark.strays import stray_engines

    dirty = [line for line in _git("status", "--porcelain").splitlines() if "benchmarks/results/" not in line]
    env = {k: v for k, v in os.environ.items() if k.startswith(PERF_ENV_PREFIXES)}
    out = {"commit": head_commit(), "dirty": bool(dirty), "argv": list(argv),
           "env": env, "machine": machine_info(all_flags=True), "stray_engine_processes": len(stray_engines())}
    if engine:
        out["engine_defaults"] = ENGINE_DEFAULTS
    return out


def head_commit() -> str:
    """The checkout's commit, short ("unknown" outside git)."""
    return _git("rev-parse", "--short", "HEAD") or "unknown"


def _git(*args) -> str:
    import subprocess

    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def free_port() -> int:
    """A free TCP port on the loopback interface (for a `vllm serve`)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: str, args: list[str], log_path: Path, env: dict | None = None,
                 timeout_s: float = 300) -> tuple:
    """``vllm serve target *args`` on a free loopback port, its output in
    ``log_path``; returns (process, base URL, log file) once /health answers.
    Raises RuntimeError with the log's tail if it exits or does not come up."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from vllm_dspark.strays import warn_stray_engines

    warn_stray_engines()
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", target, "--host", "127.0.0.1", "--port", str(port),
           *args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ))
    base, deadline = f"http://127.0.0.1:{port}", time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        try:
            if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                return proc, base, log
        except OSError:
            time.sleep(1)
    stop_server((proc, base, log))
    raise RuntimeError(f"vllm serve {target} did not come up (exit {proc.returncode}):\n"
                       + Path(log_path).read_text()[-3000:])


def server_metric(base: str, name: str) -> float:
    """A `vllm serve`'s Prometheus samples whose line starts with ``name``, summed."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def stop_server(server: tuple) -> None:
    import subprocess

    proc, _, log = server
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _provenance_path(out: Path) -> Path:
    return out.with_name(out.stem + ".provenance.json")


def record_commit(out: Path, missing: str | None = None) -> str | None:
    """The commit the record at ``out`` ran at, from its provenance (``missing`` where it has none)."""
    import json

    prov = _provenance_path(out)
    return json.loads(prov.read_text()).get("commit") if prov.exists() else missing


def archive(out: Path) -> None:
    """Move the run at ``out`` (JSON, PNG, provenance) to history/<its commit>/."""
    if not out.exists():
        return
    prov = _provenance_path(out)
    try:
        commit = record_commit(out) or "unknown"
    except (OSError, ValueError):
        commit = "unknown"
    dest = RESULTS / "history" / commit
    dest.mkdir(parents=True, exist_ok=True)
    stem, n = out.stem, 1
    while (dest / f"{stem}.json").exists():
        n += 1
        stem = f"{out.stem}_{n}"
    for src, name in ((out, f"{stem}.json"), (out.with_suffix(".png"), f"{stem}.png"),
                      (prov, f"{stem}.provenance.json")):
        if src.exists():
            src.rename(dest / name)


def _acceptance(llm) -> dict:
    """A DSpark engine's cumulative (blocks verified, tokens accepted), in the
    shape of spec_counters; empty without speculation."""
    if llm.llm_engine.vllm_config.speculative_config is None:
        return {}
    snap = llm.collective_rpc("dspark_snapshot")[0]
    return {"num_drafts": snap["verified_blocks"], "num_accepted_tokens": snap["accepted_tokens"]}
