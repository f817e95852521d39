"""DSpark metrics on vLLM's Prometheus /metrics, and the periodic log line.

The controller lives in the worker process; /metrics is served by the API
server process. The worker leaves a small JSON snapshot in a directory the
serving process created (VLLM_DSPARK_METRICS_DIR, inherited by the engine's
processes), at most every SNAPSHOT_INTERVAL_S; a Prometheus collector in the
serving process turns the newest snapshots into metrics at scrape time.

Exported (all prefixed vllm_dspark:):
  verify_budget_tokens          gauge    draft tokens chosen for the last step
  verify_budget_tokens_total    counter  draft tokens chosen, all steps
  verify_length                 histogram  per-request verify lengths
  step_time_seconds{kind}       gauge    predicted / measured, last step
  cost_model_error_percent      gauge    mean |predicted - measured| / measured
  calibration_ece{mode,position,kind}  raw / calibrated, per draft position
"""

import json
import os
import tempfile
import time
from pathlib import Path

SNAPSHOT_INTERVAL_S = 0.5
PREFIX = "vllm_dspark:"


class SnapshotWriter:
    def __init__(self, directory: str | None, rank: int):
        self.path = Path(directory) / f"worker-{rank}.json" if directory else None
        self._last = 0.0

    def maybe_write(self, snapshot_fn) -> None:
        now = time.monotonic()
        if self.path is None or now - self._last < SNAPSHOT_INTERVAL_S:
            return
        self._last = now
        write_json_atomic(self.path, snapshot_fn())


def write_json_atomic(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def read_snapshots(directory: str) -> list[dict]:
    out = []
    for f in sorted(Path(directory).glob("worker-*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # mid-replace or damaged: skip this scrape
    return out


class DSparkCollector:
    """prometheus_client custom collector over the worker snapshots."""

    def __init__(self, directory: str):
        self.directory = directory

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snaps = read_snapshots(self.directory)
        if not snaps:
            return
        snap = snaps[0]  # rank 0 decides for every rank
        yield GaugeMetricFamily(PREFIX + "verify_budget_tokens",
                                "Draft tokens chosen for verification in the last step.", value=snap["last_budget"])
        yield CounterMetricFamily(PREFIX + "verify_budget_tokens", "Draft tokens chosen for verification.",
                                  value=snap["budget_tokens_total"])
        hist = snap["length_hist"]
        cum, buckets = 0, []
        for n, count in enumerate(hist):
            cum += count
            buckets.append((str(float(n)), cum))
        buckets.append(("+Inf", cum))
        yield HistogramMetricFamily(PREFIX + "verify_length", "Per-request verify length per step.",
                                    buckets=buckets, sum_value=sum(n * c for n, c in enumerate(hist)))
        step = GaugeMetricFamily(PREFIX + "step_time_seconds", "Step time, predicted by the cost model "
                                 "before the step and measured after it.", labels=["kind"])
        for kind in ("predicted", "measured"):
            value = snap.get(f"{kind}_step_s")
            if value is not None:
                step.add_metric([kind], value)
        yield step
        if snap.get("cost_model_mape") is not None:
            yield GaugeMetricFamily(PREFIX + "cost_model_error_percent",
                                    "Mean absolute step-time prediction error, percent.",
                                    value=snap["cost_model_mape"])
        cal = snap.get("calibration")
        if cal:
            ece = GaugeMetricFamily(PREFIX + "calibration_ece", "Expected calibration error of the "
                                    "confidence head per draft position.", labels=["mode", "position", "kind"])
            for mode, state in cal.items():
                for kind in ("raw", "calibrated"):
                    for pos, value in enumerate(state[f"ece_{kind}"]):
                        if value is not None:
                            ece.add_metric([mode, str(pos + 1), kind], value)
            yield ece


def install_collector() -> None:
    """In the serving process: create the snapshot directory (inherited by the
    engine processes started later) and register the collector once."""
    from vllm_dspark import envs

    directory = envs.VLLM_DSPARK_METRICS_DIR
    if directory is None:
        import atexit
        import shutil

        directory = tempfile.mkdtemp(prefix="vllm_dspark_metrics_")
        os.environ["VLLM_DSPARK_METRICS_DIR"] = directory
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return
        REGISTRY.register(DSparkCollector(directory))


def summary_line(snap: dict) -> str:
    hist = snap["length_hist"]
    reqs = sum(hist)
    mean_len = sum(n * c for n, c in enumerate(hist)) / reqs if reqs else 0.0
    pred, meas = snap.get("predicted_step_s"), snap.get("measured_step_s")
    mape = snap.get("cost_model_mape")
    cal = snap.get("calibration") or {}
    ece = {m: [round(x, 3) for x in st["ece_calibrated"] if x is not None] for m, st in cal.items()}
    load = snap.get("load") or {}
    return (f"dspark: {snap['steps']} steps, mean verify length {mean_len:.2f}, last budget "
            f"{snap['last_budget']} tokens; step {1e3 * (pred or 0):.1f} ms predicted / "
            f"{1e3 * (meas or 0):.1f} ms measured (error {mape or 0:.1f}%); calibrated ECE {ece}; "
            f"load running={load.get('running')} waiting={load.get('waiting')} kv={load.get('kv_usage')}")
