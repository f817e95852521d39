"""Controller traces: what the drafter proposed, what verification did with it,
and what each step cost, recorded from a real run for the simulator
(``python -m vllm_dspark.sim``).

Off by default; on with ``additional_config["dspark"]["trace_dir"]`` or
``VLLM_DSPARK_TRACE_DIR``. Each engine worker writes one JSON-lines file::

    {"kind": "header", "version": 1, "block_len": K, "policy": ..., "pid": ...}
    {"kind": "block", "step": s, "req": id, "greedy": b, "raw": [K logits],
     "cal": [K probabilities], "verified": n, "accepted": a}
    {"kind": "step", "step": s, "reqs": R, "tokens": B, "seconds": t,
     "draft_seconds": d, "drafted": n, "verifies": b, "depth": D, "walk_seconds": w,
     "draft_tokens": v, "accepted": a}
    {"kind": "costs", "step": s, "spec": {...}, "plain": {...}, "draft": {...}}

A block's raw confidences are the head's logits at drafting time, ``cal`` the
calibrated probabilities the controller used; ``accepted`` of ``verified`` is
known for every position only when verification was not cut (``policy:
"full"``), which is how reference traces are taken. ``costs`` lines hold the
online cost models' current fits (the last one wins).
"""

import atexit
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

TRACE_VERSION = 1
FLUSH_EVERY_STEPS = 50


class TraceError(ValueError):
    """A trace file is unusable; the message says which file, line and field."""


class TraceWriter:
    """Buffered JSON-lines writer; everything it does is skipped when tracing is off."""

    def __init__(self, trace_dir: str | Path, header: dict):
        folder = Path(trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
        self._lines = [json.dumps({"kind": "header", "version": TRACE_VERSION, "pid": os.getpid(), **header})]
        self._steps = 0
        atexit.register(self.flush)  # the tail of a run that ends between flushes

    def block(self, step: int, req: str, greedy: bool, raw: list[float], cal: list[float],
              verified: int, accepted: int) -> None:
        self._lines.append(json.dumps({
            "kind": "block", "step": step, "req": req, "greedy": greedy,
            "raw": [round(v, 4) for v in raw], "cal": [round(v, 4) for v in cal],
            "verified": verified, "accepted": accepted}))

    def step(self, costs, **fields) -> None:
        """One step's record; ``costs`` is called for the cost fits every
        FLUSH_EVERY_STEPS steps, when the buffer goes to disk."""
        self._lines.append(json.dumps({"kind": "step", **fields}))
        self._steps += 1
        if self._steps % FLUSH_EVERY_STEPS == 0:
            self._lines.append(json.dumps({"kind": "costs", "step": fields.get("step"), **costs()}))
            self.flush()

    def flush(self) -> None:
        if self._lines:
            with self.path.open("a") as fh:
                fh.write("\n".join(self._lines) + "\n")
            self._lines = []


@dataclass
class Trace:
    """One or more trace files, read and checked."""

    block_len: int
    # request id -> its blocks in drafting order: (raw [K], cal [K], greedy, verified, accepted)
    requests: dict[str, list[tuple[list[float], list[float], bool, int, int]]] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    costs: dict | None = None
    files: list[str] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return sum(len(b) for b in self.requests.values())


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise TraceError(f"{where}: {what}")


def _read_file(path: Path, trace: Trace | None) -> Trace:
    with path.open() as fh:
        lines = fh.read().splitlines()
    _need(bool(lines), str(path), "empty file; a trace starts with a header line")
    for i, line in enumerate(lines, 1):
        where = f"{path}:{i}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e})") from None
        _need(isinstance(rec, dict) and "kind" in rec, where, 'each line must be a JSON object with a "kind"')
        kind = rec["kind"]
        if i == 1:
            _need(kind == "header", where, f'the first line must be the header, got kind={kind!r}')
            _need(rec.get("version") == TRACE_VERSION, where,
                  f"trace version {rec.get('version')!r}; this reader knows version {TRACE_VERSION}")
            k = rec.get("block_len")
            _need(isinstance(k, int) and k >= 1, where, f'"block_len" must be an int >= 1, got {k!r}')
            if trace is None:
                trace = Trace(block_len=k)
            _need(k == trace.block_len, where, f"block_len {k} differs from {trace.block_len} in {trace.files}")
            trace.files.append(str(path))
            continue
        if kind == "block":
            try:
                raw, cal = [float(v) for v in rec["raw"]], [float(v) for v in rec["cal"]]
                n, a, greedy, req = int(rec["verified"]), int(rec["accepted"]), bool(rec["greedy"]), rec["req"]
            except (KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{where}: block record lacks or mangles a field ({e!r}); it needs "
                                 "req, greedy, raw, cal, verified, accepted") from None
            _need(len(raw) == len(cal) == trace.block_len, where,
                  f'"raw" and "cal" must have block_len={trace.block_len} values')
            _need(0 <= a <= n <= trace.block_len, where, f"need 0 <= accepted ({a}) <= verified ({n}) <= block_len")
            trace.requests.setdefault(f"{len(trace.files)}:{req}", []).append((raw, cal, greedy, n, a))
        elif kind == "step":
            _need(all(isinstance(rec.get(f), (int, float)) for f in ("reqs", "tokens", "seconds")), where,
                  'a step record needs numeric "reqs", "tokens" and "seconds"')
            trace.steps.append(rec)
        elif kind == "costs":
            trace.costs = rec
        else:
            raise TraceError(f"{where}: unknown kind {kind!r}; expected header, block, step or costs")
    return trace


def load_trace(path: str | Path) -> Trace:
    """A trace file, or every ``*.jsonl`` in a folder, as one Trace."""
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise TraceError(f"{str(path)!r}: no trace file there (expected a .jsonl file or a folder of them)")
    trace = None
    for f in files:
        trace = _read_file(f, trace)
    if not trace.requests:
        raise TraceError(f"{str(path)!r}: no block records; record with policy \"full\" while serving")
    return trace
