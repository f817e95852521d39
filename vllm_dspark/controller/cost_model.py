"""Online step-time model T(R, B), learned while serving.

    T(R, B) = t0 + tR * R + tB * B        (seconds)

R is the number of requests in the step and B the tokens the target runs
(verified drafts, bonus slots and prefill chunks). The coefficients come from
exponentially weighted least squares (old steps fade out, so the model follows
the machine when the curve shifts: another process takes the CPU, clocks
change) with a constant ridge pull toward a weak prior. The ridge keeps
directions the traffic does not excite (R constant at batch 1, say) from
drifting, where plain recursive least squares with forgetting winds up.
No offline profiling: it starts from a saved fit for the same hardware/model
fingerprint if there is one, else from a weak prior, and is usable after a few
dozen steps. The fit is saved as JSON under that fingerprint.
"""

import hashlib
import json
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

# Forgetting factor: observations older than ~1/(1-lambda) steps fade out.
FORGETTING = 0.99
# Prior: 5 ms per step, 0.1 ms per request, 0.1 ms per token, and its weight
# in units of observations (per coefficient, on feature scales below).
PRIOR = (5e-3, 1e-4, 1e-4)
PRIOR_WEIGHT = 0.01
# Features are [1, R / 64, B / 512] so the three coefficients are of similar size.
FEATURE_SCALE = (1.0, 64.0, 512.0)
# Steps whose time exceeds this multiple of the prediction are stalls (GC, a
# neighbour burst, a blocked queue): they update the error statistics but not
# the fit.
OUTLIER_RATIO = 4.0
SCHEMA_VERSION = 2
# The reported error is over this many recent steps (the early steps, made
# with the prior, say little about the fit).
ERROR_WINDOW = 500


@dataclass(frozen=True)
class CostParams:
    """What the policy needs: T(R, B) = t0 + tR R + tB B."""

    t0: float
    t_req: float
    t_tok: float

    def predict(self, num_reqs: float, num_tokens: float) -> float:
        return max(1e-6, self.t0 + self.t_req * num_reqs + self.t_tok * num_tokens)


class OnlineCostModel:
    def __init__(self, fingerprint: str = "", cache_dir: Path | None = None,
                 forgetting: float = FORGETTING):
        self.fingerprint = fingerprint
        self.path = (cache_dir / f"cost_model_{fingerprint}.json") if cache_dir and fingerprint else None
        self.forgetting = forgetting
        scale = torch.tensor(FEATURE_SCALE, dtype=torch.float64)
        self._scale = scale
        self._prior = torch.tensor(PRIOR, dtype=torch.float64) * scale  # in scaled units
        self.xtx = torch.zeros(3, 3, dtype=torch.float64)  # decayed sum of x x^T
        self.xty = torch.zeros(3, dtype=torch.float64)  # decayed sum of x y
        self.theta = self._prior.clone()
        self.observations = 0
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # |pred - measured| / measured
        self.loaded_from: str | None = None
        if self.path is not None and self.path.is_file():
            self._load()

    # -- fitting ----------------------------------------------------------
    @property
    def params(self) -> CostParams:
        t0, tr, tt = (float(x) for x in self.theta / self._scale)
        # Physical floor: a step never gets cheaper with more work.
        return CostParams(max(t0, 1e-6), max(tr, 0.0), max(tt, 1e-7))

    def observe(self, num_reqs: int, num_tokens: int, seconds: float) -> float:
        """Record one measured step; returns the relative error of the
        prediction made before seeing it."""
        pred = self.params.predict(num_reqs, num_tokens)
        rel_err = abs(pred - seconds) / max(seconds, 1e-9)
        self.errors.append(rel_err)
        if self.observations > 20 and seconds > OUTLIER_RATIO * pred:
            return rel_err
        x = torch.tensor([1.0, num_reqs, num_tokens], dtype=torch.float64) / self._scale
        self.xtx = self.forgetting * self.xtx + torch.outer(x, x)
        self.xty = self.forgetting * self.xty + x * seconds
        self._solve()
        self.observations += 1
        return rel_err

    def _solve(self) -> None:
        ridge = PRIOR_WEIGHT * torch.eye(3, dtype=torch.float64)
        self.theta = torch.linalg.solve(self.xtx + ridge, self.xty + ridge @ self._prior)

    @property
    def mean_abs_pct_error(self) -> float | None:
        """Mean |predicted - measured| / measured over recent steps, in percent
        (each prediction made before its step was observed)."""
        return 100.0 * sum(self.errors) / len(self.errors) if self.errors else None

    # -- persistence ------------------------------------------------------
    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"schema_version": SCHEMA_VERSION, "fingerprint": self.fingerprint,
                "xtx": self.xtx.tolist(), "xty": self.xty.tolist(),
                "observations": self.observations, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, self.path)  # atomic: readers never see half a file

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            if data.get("schema_version") != SCHEMA_VERSION or data.get("fingerprint") != self.fingerprint:
                return
            xtx = torch.tensor(data["xtx"], dtype=torch.float64)
            xty = torch.tensor(data["xty"], dtype=torch.float64)
            if xtx.shape != (3, 3) or xty.shape != (3,) or not (torch.isfinite(xtx).all() and torch.isfinite(xty).all()):
                return
        except (OSError, ValueError, KeyError, TypeError):
            return  # a damaged cache is ignored, never fatal
        # Start from the saved fit, weighted like a short history, so new data
        # takes over quickly if the machine has changed.
        weight = min(1.0, 50.0 / max(float(xtx[0, 0]), 1e-9))
        self.xtx, self.xty = xtx * weight, xty * weight
        self._solve()
        self.observations = int(data.get("observations", 0))
        self.loaded_from = str(self.path)


def fingerprint(*parts: object) -> str:
    """Stable short hash of what determines the cost curve."""
    text = json.dumps([str(p) for p in parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]

