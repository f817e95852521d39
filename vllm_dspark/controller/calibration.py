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
identity (alpha = 1, beta = 0). Parameters only change from past outcomes, so
applying them to this step's confidences stays non-anticipating.

ECE per position is tracked for both raw and calibrated confidences
(predictions are scored before their outcome updates the fit).
"""

import torch

ECE_BINS = 10
DECAY = 0.999  # per observed step
RIDGE = 1e-2  # keeps the 2x2 Newton system well posed before data arrives


class PositionCalibrator:
    def __init__(self, num_positions: int, refit_every: int = 20):
        k = num_positions
        self.alpha = torch.ones(k, dtype=torch.float64)
        self.beta = torch.zeros(k, dtype=torch.float64)
        self.refit_every = refit_every
        self._steps = 0
        # Observed (raw logit, outcome) pairs since the last refit, and the
        # decayed history they join.
        self._z: list[torch.Tensor] = []
        self._pos: list[torch.Tensor] = []
        self._y: list[torch.Tensor] = []
        self._hist_z = torch.empty(0, dtype=torch.float64)
        self._hist_pos = torch.empty(0, dtype=torch.long)
        self._hist_y = torch.empty(0, dtype=torch.float64)
        self._hist_w = torch.empty(0, dtype=torch.float64)
        # ECE bins per position: count, sum of predictions, sum of outcomes.
        self.bins = {kind: torch.zeros(k, ECE_BINS, 3, dtype=torch.float64) for kind in ("raw", "calibrated")}

    def calibrate(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional confidences for raw logits [R, K] (float32)."""
        k = logits.shape[1]
        a = self.alpha[:k].to(logits.device, torch.float32)
        b = self.beta[:k].to(logits.device, torch.float32)
        return torch.sigmoid(logits.float() * a + b)

    def observe(self, logits: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """Outcomes of one step. logits [R, K] raw confidence logits of the
        verified blocks; verified [R] tokens verified; accepted [R] accepted."""
        logits = logits.detach().double().cpu()
        verified, accepted = verified.long().cpu(), accepted.long().cpu()
        r, k = logits.shape
        pos = torch.arange(k).expand(r, k)
        seen = pos <= torch.minimum(accepted, verified - 1)[:, None]  # through the first rejection
        if not bool(seen.any()):
            return
        z, p, y = logits[seen], pos[seen], (pos < accepted[:, None])[seen].double()
        self._score(z, p, y)
        self._z.append(z)
        self._pos.append(p)
        self._y.append(y)
        self._steps += 1
        if self._steps % self.refit_every == 0:
            self._refit()

    def _score(self, z, pos, y) -> None:
        for kind, prob in (("raw", torch.sigmoid(z)), ("calibrated", torch.sigmoid(z * self.alpha[pos] + self.beta[pos]))):
            b = (prob * ECE_BINS).long().clamp(max=ECE_BINS - 1)
            table = self.bins[kind]
            for col, val in enumerate((torch.ones_like(prob), prob, y)):
                table[..., col].index_put_((pos, b), val, accumulate=True)

    def _refit(self) -> None:
        new_z, new_pos, new_y = torch.cat(self._z), torch.cat(self._pos), torch.cat(self._y)
        self._z, self._pos, self._y = [], [], []
        decay = DECAY ** self.refit_every
        self._hist_w = torch.cat([self._hist_w * decay, torch.ones_like(new_z)])
        self._hist_z = torch.cat([self._hist_z, new_z])
        self._hist_pos = torch.cat([self._hist_pos, new_pos])
        self._hist_y = torch.cat([self._hist_y, new_y])
        keep = self._hist_w > 1e-3  # forget what has decayed away
        self._hist_w, self._hist_z = self._hist_w[keep], self._hist_z[keep]
        self._hist_pos, self._hist_y = self._hist_pos[keep], self._hist_y[keep]
        for k in range(self.alpha.numel()):
            sel = self._hist_pos == k
            if int(sel.sum()) < 10:
                continue
            self.alpha[k], self.beta[k] = _platt_newton(
                self._hist_z[sel], self._hist_y[sel], self._hist_w[sel], self.alpha[k], self.beta[k])

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


def _platt_newton(z, y, w, alpha, beta, iters: int = 8):
    """Weighted logistic regression of y on z (2 parameters), from (alpha, beta)."""
    theta = torch.stack([alpha, beta]).double()
    x = torch.stack([z, torch.ones_like(z)], dim=1)
    for _ in range(iters):
        p = torch.sigmoid(x @ theta)
        grad = x.T @ (w * (p - y)) + RIDGE * (theta - torch.tensor([1.0, 0.0], dtype=torch.float64))
        hess = (x.T * (w * p * (1 - p))) @ x + RIDGE * torch.eye(2, dtype=torch.float64)
        theta = theta - torch.linalg.solve(hess, grad)
    return theta[0], theta[1]
