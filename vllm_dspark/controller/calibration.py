"""Online per-position calibration of the confidence head.

The head predicts, for draft position k, the probability that the token is
accepted given that positions before it were. Raw, it is trained against an
analytic proxy with teacher-forced inputs, so it drifts from what verification
actually does. Here each position gets a Platt scaling,

    c_k = sigmoid(alpha_k * z_k + beta_k)        (z_k = raw logit),

fitted online on the outcomes verification reports: positions up to and
including the first rejection are observed (accepted = 1, rejected = 0);
later positions are not. The fit is a damped Newton step on exponentially
decayed sufficient statistics every ``refit_every`` steps, so the survival
products a_k = prod_{i<=k} c_i become probabilities. It starts at the
identity (alpha = 1, beta = 0). A position with no fit of its own yet takes
the nearest shallower position's: deep positions are verified least, and
their raw head is the most overconfident (on the Intel host, fp32, c=1,
positions 6 and 7 of 7 went unfitted through a 1,600-step run with raw ECE
0.46-0.63, and walks 7 deep were chosen on a fifth of the steps).
Parameters only change from past outcomes, so applying them to this step's
confidences stays non-anticipating.

ECE per position is tracked for both raw and calibrated confidences
(predictions are scored before their outcome updates the fit). A step only
queues its outcomes (as Python lists: at a few requests a step's tensors cost
more to make than everything else it does here); scoring and fitting run
batched at each refit, which keeps the per-step cost to an append.
"""

import torch

from vllm_dspark.controller.tuning import CalibrationTuning


class PositionCalibrator:
    def __init__(self, num_positions: int, tuning: CalibrationTuning = CalibrationTuning()):
        k = num_positions
        self.tuning = tuning
        self.refit_every = tuning.refit_every
        self._steps = 0
        self._queued: list[tuple[list[list[float]], list[int], list[int]]] = []  # unscored steps
        nb = int(round((tuning.z_max - tuning.z_min) / tuning.z_bin)) + 1
        self._z_centers = torch.linspace(tuning.z_min, tuning.z_max, nb, dtype=torch.float64)
        self._w_acc = torch.zeros(k, nb, dtype=torch.float64)
        self._w_rej = torch.zeros(k, nb, dtype=torch.float64)
        # ECE bins per position: count, sum of predictions, sum of outcomes.
        self._bins = {kind: torch.zeros(k, tuning.ece_bins, 3, dtype=torch.float64)
                      for kind in ("raw", "calibrated")}
        self._fitted = torch.zeros(k, dtype=torch.bool)  # positions fitted on their own outcomes
        self._set_params(torch.ones(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64))

    def _set_params(self, alpha: torch.Tensor, beta: torch.Tensor) -> None:
        self.alpha, self.beta = alpha, beta
        # What calibrate() applies, made once per fit instead of once per call.
        self._applied = (alpha.float(), beta.float())

    @property
    def bins(self) -> dict[str, torch.Tensor]:
        self._score_queued()
        return self._bins

    def calibrate(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional confidences for raw logits [R, K] (float32)."""
        k = logits.shape[1]
        a, b = self._applied
        if a.device != logits.device:
            self._applied = a, b = a.to(logits.device), b.to(logits.device)
        return torch.sigmoid(torch.addcmul(b[:k], logits.float(), a[:k]))

    def observe(self, logits, verified, accepted) -> None:
        """Outcomes of one step. logits [R, K] raw confidence logits of the
        verified blocks; verified [R] tokens verified; accepted [R] accepted
        (tensors or lists)."""
        self._queued.append(tuple(x.tolist() if torch.is_tensor(x) else x for x in (logits, verified, accepted)))
        self._steps += 1
        if self._steps % self.refit_every == 0:
            self._refit()

    def _score_queued(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Score the queued steps with the parameters they were made under
        (parameters only change at a refit, which scores first); returns the
        observed (logit, position, outcome) triples."""
        if not self._queued:
            return None
        queued, self._queued = self._queued, []
        # Positions through the first rejection, picked in Python (a few per
        # block): cheaper than padding, masking and gathering as tensors.
        z, p, y = [], [], []
        for logits, verified, accepted in queued:
            for row, n, a in zip(logits, verified, accepted):
                for j in range(min(a, n - 1, len(row) - 1) + 1):
                    z.append(row[j])
                    p.append(j)
                    y.append(1.0 if j < a else 0.0)
        if not z:
            return None
        z, p, y = torch.tensor(z, dtype=torch.float64), torch.tensor(p), torch.tensor(y, dtype=torch.float64)
        self._score(z, p, y)
        return z, p, y

    def _score(self, z, pos, y) -> None:
        for kind, prob in (("raw", torch.sigmoid(z)), ("calibrated", torch.sigmoid(z * self.alpha[pos] + self.beta[pos]))):
            bins = self.tuning.ece_bins
            b = (prob * bins).long().clamp(max=bins - 1)
            table = self._bins[kind]
            for col, val in enumerate((torch.ones_like(prob), prob, y)):
                table[..., col].index_put_((pos, b), val, accumulate=True)

    def _refit(self) -> None:
        t = self.tuning
        observed = self._score_queued()
        decay = t.decay ** self.refit_every
        self._w_acc *= decay
        self._w_rej *= decay
        if observed is not None:
            z, p, y = observed
            b = ((z.clamp(t.z_min, t.z_max) - t.z_min) / t.z_bin).round().long()
            self._w_acc.index_put_((p, b), y, accumulate=True)
            self._w_rej.index_put_((p, b), 1.0 - y, accumulate=True)
        ready = (self._w_acc + self._w_rej).sum(1) >= t.min_weight
        if bool(ready.any()):
            alpha, beta = _platt_newton(self._z_centers, self._w_acc, self._w_rej, self.alpha, self.beta, t)
            alpha, beta = torch.where(ready, alpha, self.alpha), torch.where(ready, beta, self.beta)
            self._fitted |= ready
            for j in range(1, len(alpha)):  # unfitted: the nearest shallower fit
                if not self._fitted[j]:
                    alpha[j], beta[j] = alpha[j - 1], beta[j - 1]
            self._set_params(alpha, beta)

    def ece(self, kind: str = "calibrated") -> list[float | None]:
        """Expected calibration error per position, over everything scored."""
        out = []
        for table in self.bins[kind]:
            n = table[:, 0].sum()
            if n == 0:
                out.append(None)
                continue
            gap = (table[:, 1] - table[:, 2]).abs()  # |sum pred - sum outcome| per bin
            out.append(float(gap.sum() / n))
        return out

    def state(self) -> dict:
        return {"alpha": self.alpha.tolist(), "beta": self.beta.tolist(),
                "ece_raw": self.ece("raw"), "ece_calibrated": self.ece("calibrated")}


def _platt_newton(z, w_acc, w_rej, alpha, beta, t: CalibrationTuning):
    """Weighted logistic regression of outcome on logit, per position, from
    (alpha, beta): z [NB] bin centres, w_acc / w_rej [K, NB] outcome weights.
    Newton steps with the 2x2 systems solved in closed form for all K at once."""
    w = w_acc + w_rej
    ridge = t.ridge
    for _ in range(t.newton_iters):
        p = torch.sigmoid(alpha[:, None] * z + beta[:, None])
        r = w * p - w_acc
        g_a = (r * z).sum(1) + ridge * (alpha - 1.0)
        g_b = r.sum(1) + ridge * beta
        h = w * p * (1.0 - p)
        h_aa = (h * z * z).sum(1) + ridge
        h_ab = (h * z).sum(1)
        h_bb = h.sum(1) + ridge
        det = h_aa * h_bb - h_ab * h_ab
        d_a = (h_bb * g_a - h_ab * g_b) / det
        d_b = (h_aa * g_b - h_ab * g_a) / det
        # Damped: outcomes that are (nearly) separable on the binned logits
        # send plain Newton off to infinity; at most a unit step per iteration.
        move = torch.maximum(d_a.abs(), d_b.abs())
        shrink = torch.clamp(move, min=1.0)
        alpha = alpha - torch.nan_to_num(d_a / shrink)
        beta = beta - torch.nan_to_num(d_b / shrink)
        if float(torch.nan_to_num(move, nan=0.0).max()) < t.newton_tol:
            break
    return alpha.clamp(0.0, t.param_bound), beta.clamp(-t.param_bound, t.param_bound)
