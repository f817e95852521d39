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

It runs on every step, so it is plain Python on three features (a 3x3
solve), not torch: a handful of small torch ops costs more than the math.
"""

import json
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from vllm_dspark.controller.tuning import CostModelTuning
from vllm_dspark.metrics import write_json_atomic

SCHEMA_VERSION = 5  # of the saved file; 5: the drafting model no longer holds the Markov walk


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
                 tuning: CostModelTuning = CostModelTuning()):
        self.fingerprint = fingerprint
        self.path = (cache_dir / f"cost_model_{fingerprint}.json") if cache_dir and fingerprint else None
        self.tuning = tuning
        self._scale = tuning.feature_scale
        self._prior = [p * s for p, s in zip(tuning.prior, self._scale)]  # in scaled units
        self.xtx = [[0.0] * 3 for _ in range(3)]  # decayed sum of x x^T
        self.xty = [0.0] * 3  # decayed sum of x y
        self._seen: dict[tuple[int, int], float] = {}  # (requests, tokens) power-of-two class -> decayed steps
        self.theta = list(self._prior)
        self._params = self._to_params()
        self.observations = 0
        self.idle = 0  # steps since the last observation that it did not learn from (fade)
        self.errors: deque[float] = deque(maxlen=tuning.error_window)  # |pred - measured| / measured
        self.loaded_from: str | None = None
        self.pinned = False
        if self.path is not None and self.path.is_file():
            self._load()

    # -- fitting ----------------------------------------------------------
    @property
    def params(self) -> CostParams:
        return self._params

    def _to_params(self) -> CostParams:
        t0, tr, tt = (t / s for t, s in zip(self.theta, self._scale))
        # Physical floor: a step never gets cheaper with more work.
        return CostParams(max(t0, 1e-6), max(tr, 0.0), max(tt, 1e-7))

    @property
    def trusted(self) -> bool:
        """Pinned, or fitted on enough steps to be believed."""
        return self.pinned or self.observations >= self.tuning.min_observations

    def pin(self, params: CostParams, source: str) -> None:
        """Use ``params`` from now on: no learning, no saving (a cost curve
        the user measured; see cost_curve.py). Errors are still tracked."""
        self._params, self.pinned, self.path, self.loaded_from = params, True, None, source

    def observe(self, num_reqs: int, num_tokens: int, seconds: float, steps: int = 1) -> float:
        """Record one measured step, or the mean ``seconds`` of ``steps`` alike
        run back to back (weighed as that many: older steps fade by as many);
        returns the relative error of the prediction made before seeing it."""
        pred = self.params.predict(num_reqs, num_tokens)
        rel_err = abs(pred - seconds) / max(seconds, 1e-9)
        self.errors.append(rel_err)
        tuning = self.tuning
        if self.pinned or (self.observations > tuning.min_observations and seconds > tuning.outlier_ratio * pred):
            return rel_err
        scale = self._scale
        x = (1.0 / scale[0], num_reqs / scale[1], num_tokens / scale[2])
        lam, self.idle = tuning.forgetting ** (steps + self.idle), 0
        seen = self._seen
        for key in list(seen):
            seen[key] *= lam
            if seen[key] < 1e-3:
                del seen[key]
        key = (num_reqs.bit_length(), num_tokens.bit_length())
        seen[key] = seen.get(key, 0.0) + steps
        wx = (steps * x[0], steps * x[1], steps * x[2])  # the run weighs as its steps
        for row, wi in zip(self.xtx, wx):  # in place: three of these run every step
            row[0] = lam * row[0] + wi * x[0]
            row[1] = lam * row[1] + wi * x[1]
            row[2] = lam * row[2] + wi * x[2]
        self.xty = [lam * y + wi * seconds for y, wi in zip(self.xty, wx)]
        self.observations += 1
        # Refit every step while the statistics are light (young, or faded: fade).
        if self.xtx[0][0] <= tuning.refit_warmup or self.observations % tuning.refit_every == 0:
            self._solve()
        return rel_err

    def fade(self) -> None:
        """A step ran that this model does not learn from (the nospec models
        while speculating). ``idle`` counts them; at the next observation
        what the model saw fades as though they had been observed, so a
        model that was not fed for a long stretch takes its next few steps'
        word, not its old fit's (awake, no plain step refreshes the nospec
        models: an engine priced a no-spec step from a slow spell's warm-up at
        1.9x its time and drafted on at 0.90x no-spec, its budget measuring
        a gain)."""
        if not self.pinned:
            self.idle += 1

    def _solve(self) -> None:
        w = self.tuning.prior_weight
        a = [[self.xtx[i][j] + (w if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [self.xty[i] + w * self._prior[i] for i in range(3)]
        self.theta = _solve_nonnegative(a, b)
        self._params = self._to_params()

    def token_spread(self) -> float:
        """How much the observed B varied beyond what R explains, relative to
        its mean (the decayed partial standard deviation of B given [1, R],
        over mean B). Near 0, the per-token cost is not identified."""
        m = self.xtx
        n = m[0][0]
        if n <= 0 or m[0][2] <= 0:
            return 0.0
        det = m[0][0] * m[1][1] - m[0][1] ** 2
        if det <= 1e-12 * n * n:  # R never varied: the variance of B about its mean
            resid = m[2][2] - m[0][2] ** 2 / n
        else:
            v0, v1 = m[0][2], m[1][2]
            resid = m[2][2] - (m[1][1] * v0 * v0 - 2 * m[0][1] * v0 * v1 + m[0][0] * v1 * v1) / det
        return math.sqrt(max(resid, 0.0) / n) / (m[0][2] / n)

    def covers(self, num_reqs: int, num_tokens: int | None = None) -> bool:
        """Has the model seen steps of about ``num_reqs`` requests (and
        ``num_tokens`` tokens) lately: within two decayed standard deviations
        of their mean (or 25% of it), or in the same power-of-two class, a
        decayed step's worth? Outside that its cost is an extrapolation, which
        a model fitted at one batch size cannot make (it splits a single step
        time between t0 and t_req arbitrarily). The classes matter where the
        batch size keeps changing (light arrivals: 1-4 requests): plain steps
        at one and at four requests left a window around their mean that held
        neither, and episodes that gained ended unpriced."""
        if self.pinned:
            return True
        n = self.xtx[0][0]
        if n < 1.0:
            return False
        cls = num_reqs.bit_length()
        seen = (sum(w for (r, _), w in self._seen.items() if r == cls) if num_tokens is None
                else self._seen.get((cls, num_tokens.bit_length()), 0.0))
        if seen >= 1.0:
            return True
        return self._near(1, num_reqs, n) and (num_tokens is None or self._near(2, num_tokens, n))

    def _near(self, i: int, value: float, n: float) -> bool:
        scale = self._scale[i]
        mean = self.xtx[0][i] / n * scale
        std = math.sqrt(max(self.xtx[i][i] / n * scale * scale - mean * mean, 0.0))
        return abs(value - mean) <= max(2.0 * std, 0.25 * mean)

    @property
    def mean_abs_pct_error(self) -> float | None:
        """Mean |predicted - measured| / measured over recent steps, in percent
        (each prediction made before its step was observed)."""
        return 100.0 * sum(self.errors) / len(self.errors) if self.errors else None

    # -- persistence ------------------------------------------------------
    def saved(self) -> tuple[Path, dict] | None:
        """Where the fit goes and what (None: not persisted), copied now, so
        another thread may write it (write_saved) while this one learns on."""
        if self.path is None:
            return None
        return self.path, {"schema_version": SCHEMA_VERSION, "fingerprint": self.fingerprint,
                           "xtx": [row[:] for row in self.xtx], "xty": self.xty[:],
                           "observations": self.observations, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            if data.get("schema_version") != SCHEMA_VERSION or data.get("fingerprint") != self.fingerprint:
                return
            xtx = [[float(v) for v in row] for row in data["xtx"]]
            xty = [float(v) for v in data["xty"]]
            if len(xtx) != 3 or any(len(row) != 3 for row in xtx) or len(xty) != 3:
                return
            if not all(math.isfinite(v) for v in [*xty, *(v for row in xtx for v in row)]):
                return
        except (OSError, ValueError, KeyError, TypeError):
            return  # a damaged cache is ignored, never fatal
        # Start from the saved fit, weighted like a short history, so new data
        # takes over quickly if the machine has changed.
        weight = min(1.0, 50.0 / max(xtx[0][0], 1e-9))
        self.xtx = [[v * weight for v in row] for row in xtx]
        self.xty = [v * weight for v in xty]
        self._solve()
        self.observations = int(data.get("observations", 0))
        self.loaded_from = str(self.path)


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a small symmetric positive definite ``a`` (the ridge
    guarantees it): Gaussian elimination without pivoting."""
    n = len(b)
    a = [row[:] + [v] for row, v in zip(a, b)]
    for i in range(n):
        for r in range(i + 1, n):
            f = a[r][i] / a[i][i]
            for c in range(i, n + 1):
                a[r][c] -= f * a[i][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][c] * x[c] for c in range(i + 1, n))) / a[i][i]
    return x


# Free-coefficient sets tried when the unconstrained fit has a negative one,
# largest first.
_SUBSETS = [(0, 1), (0, 2), (1, 2), (0,), (1,), (2,)]


def _solve_nonnegative(a: list[list[float]], b: list[float]) -> list[float]:
    """argmin x'ax - 2b'x subject to x >= 0 (3 coefficients). Fitting freely
    and clamping afterwards is wrong: traffic that keeps B proportional to R
    (drafting: B = K R) lets one coefficient go negative to pay for another,
    and clamping it leaves the others far off. With three coefficients every
    active set can simply be tried."""
    x = _solve_spd(a, b)
    if min(x) >= 0:
        return x
    best, best_obj = [0.0, 0.0, 0.0], 0.0
    for free in _SUBSETS:
        sub = _solve_spd([[a[i][j] for j in free] for i in free], [b[i] for i in free])
        if min(sub) < 0:
            continue
        cand = [0.0, 0.0, 0.0]
        for i, v in zip(free, sub):
            cand[i] = v
        obj = sum(cand[i] * a[i][j] * cand[j] for i in range(3) for j in range(3)) - 2 * sum(
            bi * xi for bi, xi in zip(b, cand))
        if obj < best_obj:
            best, best_obj = cand, obj
    return best


def write_saved(saved: list[tuple[Path, dict]]) -> None:
    """Write what ``saved`` returned, each file atomically (readers never see
    half a file). A cache that cannot be written is warned about, not fatal:
    the engine only learns from scratch next time."""
    for path, data in saved:
        try:
            write_json_atomic(path, data)
        except OSError as exc:
            if path.parent not in _UNWRITABLE:  # once per folder: a save comes every few seconds
                _UNWRITABLE.add(path.parent)
                from vllm_dspark.log import get_logger

                get_logger(__name__).warning("Learned step costs not saved to %s (%s): set VLLM_DSPARK_CACHE_DIR "
                                             "to a writable folder, or persist_cost_model to false.", path.parent, exc)
            return


_UNWRITABLE: set[Path] = set()  # cache folders a save failed in (warned about once)
