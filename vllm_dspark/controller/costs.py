"""What a step will cost: the online step-time models and the bridge between two of them.

  verify  T_spec(R, B)   a target step that verifies drafts (R requests, B tokens)
  plain   T_plain(R, B)  a target step that does not
  draft   T_draft(R, B)  drafting R blocks of B query positions in all, less the Markov walk
  walk    T_walk(R)      one position of the Markov walk over R blocks
  nospec  T_none(R, B)   a step run without speculation (plain steps only: what
                         the exploration budget measures speculation against)
  decode  T_none(R, R)   the same, decode steps only (B = R): the budget's price
                         of a decoded token. Fitted beside prompt steps, a line
                         in B put a 4-request decode step 25-30% above its time.
                         Both learn in the machine's pace units (pace.py), and
                         neither while a fresh engine serves its first requests
                         (warm_up): it runs slow then, and a price set there
                         made drafting steps that lost look like gains.

The engine runs mostly one kind of target step at a time, so when the load
moves, the model of the other kind extrapolates in R from another batch size
(badly: fitted at one R it splits a step between t0 and t_req arbitrarily).
A model that has not seen about this R lately is replaced by the other one
plus or minus the verify path's measured overhead (an EMA over plain steps).
"""

import threading
from collections import deque
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

from vllm_dspark.controller.clock import StepSample
from vllm_dspark.controller.cost_curve import CostCurve
from vllm_dspark.controller.cost_model import CostParams, OnlineCostModel, write_saved
from vllm_dspark.controller.pace import MachinePace
from vllm_dspark.controller.tuning import ControllerTuning


class CostEstimate(NamedTuple):
    """Predicted seconds for the next step."""

    base: float  # a verify step, less its drafts
    plain: float  # a plain step
    draft: float  # drafting, at the depth asked for
    per_token: float  # each verified draft token


class StepCosts:
    def __init__(self, block_len: int, tuning: ControllerTuning, fingerprint: str = "",
                 cache_dir: Path | None = None, price_walk: bool = True, sized_block: bool = False,
                 pace: MachinePace | None = None):
        """``pace``: the nospec and decode models learn in its units (pace.py)."""
        self.k, self.pace = block_len, pace or MachinePace(tuning)
        self._overhead_ema = tuning.overhead_ema
        self._min_spread = tuning.min_token_spread

        def model(kind: str) -> OnlineCostModel:
            return OnlineCostModel(f"{fingerprint}-{kind}" if fingerprint else "", cache_dir, tuning.cost)

        self.verify, self.plain, self.draft, self.walk, self.nospec, self.decode = (
            model(k) for k in ("spec", "plain", "draft", "walk", "nospec-paced", "decode-paced"))
        self._price_walk = price_walk  # the adaptive_depth knob
        self._sized_block = sized_block  # the depth_sized_block knob: a block as deep as its walk
        self._overhead: float | None = None  # verify step minus plain step, same R and B
        self._errors: deque[float] = deque(maxlen=tuning.cost.error_window)  # whole-step prediction error
        self._alone = False  # a user's pinned curve decides alone: margin()
        self._shapes: set[tuple[int, int]] = set()  # step shapes run so far: first_run
        self._warming = tuning.price_warmup_steps  # plain steps the warm-up may still take (warm_up)
        self._first: frozenset[str] | None = None  # the engine's first requests (warm_up)
        self._writer: threading.Thread | None = None  # the last save's (save)

    def pin(self, curve: CostCurve, source: str, alone: bool = False) -> None:
        """Use ``curve``'s fixed costs instead of learning them online
        (``alone``: the user's curve decides without a margin, see margin())."""
        self._alone = alone
        for model, params in ((self.verify, curve.spec), (self.plain, curve.plain),
                              (self.draft, curve.draft), (self.walk, curve.walk)):
            if params is not None:
                model.pin(params, source)

    def walk_priced(self) -> bool:
        """Is the walk priced apart (and so its depth chosen)? Not when the
        knob says no, nor while its model is young, nor with a pinned cost
        curve without a "walk" (its drafting cost holds the walk)."""
        return self._price_walk and self.walk.trusted and (self.walk.pinned or not self.draft.pinned)

    def draft_seconds(self, rows: int, depth: int) -> float:
        """Predicted drafting time for ``rows`` blocks walked ``depth`` deep."""
        if not self.walk_priced():
            return self.draft.params.predict(rows, rows * self.k)
        return self.draft.params.predict(rows, rows * self.block(depth)) + depth * self.walk.params.predict(rows, 0)

    def block(self, depth: int) -> int:
        """Query positions per block for a walk ``depth`` deep."""
        return depth if self._sized_block else self.k

    def predict(self, rows: int, prefill: int, depth: int) -> CostEstimate:
        """The next step with ``rows`` decoding requests beside ``prefill``
        prompt tokens, drafting ``depth`` deep."""
        tokens = rows + prefill
        spec = self.verify.params
        spec_base = spec.predict(rows, tokens)
        plain = self.plain.params.predict(rows, tokens) if self.plain.trusted else spec_base
        over = self._overhead
        if over is not None:
            fresh_spec, fresh_plain = self.verify.covers(rows), self.plain.covers(rows)
            if fresh_spec and not fresh_plain:
                plain = max(spec_base - over, 1e-6)
            elif fresh_plain and not fresh_spec:
                spec_base = plain + over
        # A verify step never costs less than a plain one with the same tokens;
        # until verify steps have been seen (all skipped, or cut to nothing),
        # the plain model stands in for them.
        base = max(spec_base, plain) if self.verify.trusted else plain
        return CostEstimate(base, plain, self.draft_seconds(rows, depth), self.token_cost())

    def token_cost(self) -> float:
        """Seconds per verified draft token. While verify steps all carry about
        the same tokens (one request, whole blocks) their own slope is not
        identified and fits to about nothing, so every block was verified
        whole even where a token costs 5% of a step (AMD Zen 4, fp32, oneDNN
        capped to AVX2: about 0.35 ms at c=1). A verified token is one more
        query row through the target, as a prompt token is in a plain step,
        where prompts do identify the slope: that slope stands in, as a floor,
        until verify steps vary."""
        own = self.verify.params.t_tok
        if self.verify.pinned or not self.plain.trusted or self.verify.token_spread() >= self._min_spread:
            return own
        return max(own, self.plain.params.t_tok)

    def token_value(self, coming: int) -> float:
        """Seconds of engine time one more token is worth: what a plain decode
        step spends per token at the batch about to run (``coming``: every
        admitted or queued request, not this step's rows; prompt work left out,
        it makes a step's tokens look dear only while it lasts)."""
        return self.predict(coming, 0, self.k).plain / coming

    def first_run(self, s: StepSample) -> tuple[bool, bool]:
        """The engine's first step of this shape, for its target (its token
        count, verifying or not) and for its drafter (its blocks at its depth)?
        Its time holds the machine's one-time warm-up for the shape (vLLM's
        oneDNN linear builds a primitive for every new number of rows, among
        others), not what the kind costs; learned, it ended trials that gained
        (docs/controller.md). Each model skips only its own shape's first run:
        skipping the whole step for either, a short run's drafting model
        learned from none of its steps (each new in one or the other). The
        budget still charges it: a warm-up that speculating caused is
        speculation's cost, and leaving it out has no bound (at 16 requests
        and more almost every verify step is a new token count)."""
        target, draft = (s.tokens, s.verifies), (-s.drafted, s.depth)
        new = (target not in self._shapes, bool(s.drafted) and draft not in self._shapes)
        self._shapes.update([target, draft] if s.drafted else [target])
        return new

    def observe(self, s: StepSample, first: tuple[bool, bool] = (False, False)) -> float:
        """Learn from one step (``first``: its target's and its drafter's
        shapes run for the first time, first_run; that model only predicts);
        returns what the models predicted for it."""
        target = self.verify if s.verifies else self.plain
        target_seconds = max(s.seconds - (s.draft_seconds if s.drafted else 0.0), 1e-6)
        predicted = target.params.predict(s.reqs, s.tokens)
        walked = s.drafted and s.depth > 0 and s.walk_seconds > 0
        if s.drafted:
            predicted += self.draft_seconds(s.drafted, s.depth if walked else self.k)
        if s.drafted and not first[1]:
            self.draft.observe(s.drafted, s.drafted * (self.block(s.depth) if walked else self.k),
                               s.draft_seconds - s.walk_seconds if walked else s.draft_seconds)
            if walked:
                self.walk.observe(s.drafted, 0, s.walk_seconds / s.depth)
        if first[0]:  # what no speculation costs was measured a step longer ago
            self.nospec.fade()
            self.decode.fade()
            return predicted
        if not s.verifies and self.verify.trusted and self.verify.covers(s.reqs):
            over = self.verify.params.predict(s.reqs, s.tokens) - target_seconds
            self._overhead = (over if self._overhead is None
                              else self._overhead_ema * self._overhead + (1 - self._overhead_ema) * over)
        target.observe(s.reqs, s.tokens, target_seconds)
        if s.plain:
            self.observe_plain(s.reqs, s.tokens, s.seconds)
        else:  # what no speculation costs was measured a step longer ago
            self.nospec.fade()
            self.decode.fade()
        if not any(first):
            self._errors.append(abs(predicted - s.seconds) / s.seconds)
            self.pace.observe(s.seconds, predicted)  # how far the canary is borne out (pace.py)
        return predicted

    def warm_up(self, req_ids: Collection[str]) -> None:
        """A step of these requests starts. A fresh engine warms up until the
        requests of its first step have all finished (or ``price_warmup_steps``
        plain steps have run): served at light load, its first request's plain
        steps took 1.6x the later ones' (AMD EPYC Zen 4, bf16 capped at AVX2),
        however many steps it ran, and priced from them, drafting that lost 15%
        measured as a 30% gain (docs/tuning.md)."""
        if self._warming and req_ids:
            if self._first is None:
                self._first = frozenset(req_ids)
            elif self._first.isdisjoint(req_ids):
                self._warming = 0

    @property
    def warming(self) -> bool:
        """The engine warms up (warm_up): its plain steps teach nothing."""
        return self._warming > 0

    def observe_plain(self, reqs: int, tokens: int, seconds: float, steps: int = 1) -> None:
        """A step run without speculation (or the mean of a coasting run of
        ``steps``: coasting.py, weighed as that many steps, so the rule's dearer
        steps between runs and a fresh engine's slow early ones count at their
        share: docs/controller.md); while the engine warms up (warm_up), it
        teaches nothing."""
        if self.warming:
            self._warming = max(self._warming - steps, 0)
            return
        seconds /= self.pace.factor
        self.nospec.observe(reqs, tokens, seconds, steps)
        if tokens == reqs:
            self.decode.observe(reqs, reqs, seconds, steps)

    def model_error(self) -> float:
        """Mean relative error of the recent whole-step predictions (0 before any)."""
        errors = self._errors
        return sum(errors) / len(errors) if errors else 0.0

    @property
    def alone(self) -> bool:
        """A user's pinned curve decides, without measured corrections."""
        return self._alone

    def margin(self) -> float:
        """How far a verdict must clear zero: the models' recent error; none for
        a user's pinned curve, however far off it this machine's steps are."""
        return 0.0 if self._alone else self.model_error()

    def mape(self) -> float | None:
        return 100.0 * self.model_error() if self._errors else None

    def params_json(self) -> dict:
        return {"cost_params": vars(self.verify.params), "plain_cost_params": vars(self.plain.params),
                "draft_cost_params": vars(self.draft.params), "walk_cost_params": vars(self.walk.params),
                "nospec_cost_params": vars(self.nospec.params), "decode_cost_params": vars(self.decode.params)}

    def trace_json(self) -> dict:
        """The fits a trace records; its drafting cost is a whole K-deep
        block's (the simulator drafts those)."""
        par, walk = self.draft.params, self.walk.params
        if self.walk_priced():
            par = CostParams(par.t0 + self.k * walk.t0, par.t_req + self.k * walk.t_req, par.t_tok)
        return {"spec": vars(self.verify.params), "plain": vars(self.plain.params), "draft": vars(par)}

    def save(self) -> None:
        """Hand the models' fits to a writer thread: the step goes on at once. Six
        files took about 1 ms, at times 50 ms (this machine's overlay filesystem),
        on the step that saved. While the last writer still runs, this save is
        dropped (the next one carries newer fits)."""
        saved = [s for m in (self.verify, self.plain, self.draft, self.walk, self.nospec, self.decode)
                 if (s := m.saved()) is not None]
        if saved and not (self._writer is not None and self._writer.is_alive()):
            self._writer = threading.Thread(target=write_saved, args=(saved,), name="dspark-costs", daemon=True)
            self._writer.start()
