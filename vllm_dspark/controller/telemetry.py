"""What the controller did, for metrics, the log line, benchmarks and traces.

``ControllerSnapshot`` is the one schema all of them read: the worker's
``dspark_snapshot`` RPC and the metrics snapshot files carry its JSON, and
``ControllerSnapshot.from_json`` reads it back typed.
"""

from dataclasses import asdict, dataclass, field, fields

from vllm_dspark.controller.trace import TraceWriter


@dataclass
class ControllerTotals:
    choices: int = 0  # drafting steps whose lengths were chosen
    budget_tokens: int = 0  # draft tokens chosen for verification
    length_hist: list[int] = field(default_factory=list)  # verify lengths, per request and step
    depth_hist: list[int] = field(default_factory=list)  # walk depth per drafting step
    skipped_steps: int = 0  # steps that skipped the drafter
    verified_blocks: int = 0  # blocks with at least one draft verified
    accepted_tokens: int = 0
    contextless_requests: int = 0  # admitted while dormant
    plain_steps: int = 0  # run as vLLM's steps without speculation
    probe_steps: int = 0  # dormant steps run awake without drafts (awake.py)

    @classmethod
    def for_block(cls, k: int) -> "ControllerTotals":
        return cls(length_hist=[0] * (k + 1), depth_hist=[0] * (k + 1))


@dataclass
class LastStep:
    """The last recorded step and the last choice."""

    num_reqs: int = 0
    num_tokens: int = 0
    predicted_s: float | None = None
    measured_s: float | None = None
    budget: int = 0  # draft tokens chosen for verification next step
    lengths: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ControllerSnapshot:
    steps: int = 0  # drafting steps whose lengths were chosen
    budget_tokens_total: int = 0
    last_budget: int = 0
    length_hist: list[int] = field(default_factory=list)
    depth_hist: list[int] = field(default_factory=list)
    skipped_steps: int = 0
    contextless_requests: int = 0
    plain_steps: int = 0
    probe_steps: int = 0  # dormant steps run awake without drafts, timed against plain ones (awake.py)
    dormant: bool = False
    acceptance_ratio: float = 1.0  # the skip rule's accepted / expected tokens on recent blocks
    verified_blocks: int = 0
    accepted_tokens: int = 0
    predicted_step_s: float | None = None
    measured_step_s: float | None = None
    cost_model_mape: float | None = None  # percent, whole-step predictions
    cost_params: dict | None = None  # verify-step model
    plain_cost_params: dict | None = None
    draft_cost_params: dict | None = None
    walk_cost_params: dict | None = None
    nospec_cost_params: dict | None = None  # steps without speculation (the exploration budget's baseline)
    decode_cost_params: dict | None = None  # the same, decode steps only (its price of a decoded token)
    speculation_excess: float | None = None  # measured time speculation cost over none, share of the latter
    budget_balance_s: float = 0.0  # what exploring may still spend
    pace_factor: float = 1.0  # the budget's prices now over the first canary's pace (pace.py)
    pace_trust: float = 0.0  # how far the steps bear the canary out (0 to 1)
    price_drift: float = 1.0  # how far the open episode's verify steps lowered its price (drift.py)
    decode_price: dict | None = None  # the budget's last price of a plain decode step: seconds, requests
    awake_share: dict | None = None  # per batch size (its class's fewest requests): an awake step over a plain one
    calibration: dict | None = None  # per mode: alpha, beta, ECE raw and calibrated per position
    load: dict | None = None  # the last step's LoadSignals

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """The periodic log line (knob log_every)."""
        mean_len, mean_depth = _mean(self.length_hist), _mean(self.depth_hist)
        ece = {m: [round(x, 3) for x in st["ece_calibrated"] if x is not None]
               for m, st in (self.calibration or {}).items()}
        load = self.load or {}
        return (f"dspark: {self.steps} drafting steps, mean verify length {mean_len:.2f}, mean depth "
                f"{mean_depth:.2f}, last budget {self.last_budget} tokens; step "
                f"{1e3 * (self.predicted_step_s or 0):.1f} ms predicted / {1e3 * (self.measured_step_s or 0):.1f} ms "
                f"measured (error {self.cost_model_mape or 0:.1f}%); {self.skipped_steps} skipped, "
                f"{self.plain_steps} plain, dormant={self.dormant}; calibrated ECE {ece}; load "
                f"running={load.get('running')} waiting={load.get('waiting')} kv={load.get('kv_usage')}")

    @classmethod
    def from_json(cls, data: dict) -> "ControllerSnapshot":
        """Unknown keys are dropped and missing ones take defaults (a snapshot
        file from another version of the plugin)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class Telemetry:
    def __init__(self, block_len: int, trace_dir: str | None, policy: str, log_every: int):
        self.totals = ControllerTotals.for_block(block_len)
        self.last = LastStep()
        self.log_every = log_every
        self._next_log = log_every  # the step count the next log line is due at (steps may pass it unlogged)
        self.trace = TraceWriter(trace_dir, {"block_len": block_len, "policy": policy}) if trace_dir else None

    def chose(self, lengths: list[int], depth: int) -> None:
        t = self.totals
        self.last.budget = sum(lengths)
        self.last.lengths = lengths
        t.choices += 1
        t.budget_tokens += self.last.budget
        t.depth_hist[depth] += 1
        for n in lengths:
            t.length_hist[n] += 1

    def skipped(self) -> None:
        self.totals.skipped_steps += 1
        self.last.budget = 0

    def verified(self, num_verified: list[int], accepted: list[int]) -> None:
        self.totals.verified_blocks += sum(1 for n in num_verified if n)
        self.totals.accepted_tokens += sum(accepted)

    def recorded(self, sample, predicted: float, step: int, costs) -> None:
        """A step went into the cost models (``costs``: StepCosts, for the trace)."""
        self.last.num_reqs, self.last.num_tokens = sample.reqs, sample.tokens
        self.last.predicted_s, self.last.measured_s = predicted, sample.seconds
        if self.trace is not None:
            self.trace.step(costs.trace_json, step=step, reqs=sample.reqs, tokens=sample.tokens,
                            seconds=sample.seconds, draft_seconds=sample.draft_seconds, drafted=sample.drafted,
                            verifies=sample.verifies, depth=sample.depth, walk_seconds=sample.walk_seconds,
                            draft_tokens=sample.draft_tokens, accepted=sample.accepted)

    def trace_blocks(self, step: int, pending, outcome) -> None:
        """The verified blocks' outcomes, when tracing (``pending``: acceptance.PendingBlocks, or None)."""
        if self.trace is None or pending is None:
            return
        rows_of, raw, greedy, cal, _ = pending
        cal_rows = cal.float().cpu().tolist()
        for rid, n, a in zip(outcome.req_ids, outcome.num_verified, outcome.accepted):
            i = rows_of.get(rid)
            if i is not None and n:
                self.trace.block(step, rid, greedy[i], raw[i], cal_rows[i], n, a)

    def log_due(self, steps: int) -> bool:
        if not self.log_every or steps < self._next_log:
            return False
        self._next_log = (steps // self.log_every + 1) * self.log_every
        return True

    def snapshot(self, *, dormant: bool, acceptance, costs, load, budget, coasted: int = 0) -> ControllerSnapshot:
        """``coasted``: plain steps coasted and not booked yet (coasting.py)."""
        t, last = self.totals, self.last
        return ControllerSnapshot(
            steps=t.choices, budget_tokens_total=t.budget_tokens, last_budget=last.budget,
            length_hist=list(t.length_hist), depth_hist=list(t.depth_hist), skipped_steps=t.skipped_steps + coasted,
            contextless_requests=t.contextless_requests, plain_steps=t.plain_steps + coasted,
            probe_steps=t.probe_steps, dormant=dormant,
            acceptance_ratio=acceptance.ratio(), verified_blocks=t.verified_blocks,
            accepted_tokens=t.accepted_tokens, predicted_step_s=last.predicted_s, measured_step_s=last.measured_s,
            cost_model_mape=costs.mape(), calibration=acceptance.state(),
            load=load._asdict() if load else None, speculation_excess=budget.loss_share(),
            budget_balance_s=budget.balance, pace_factor=costs.pace.factor,
            pace_trust=costs.pace.trust, price_drift=budget.drift.factor, decode_price=budget.price,
            awake_share=budget.awake.state(), **costs.params_json())

    def log(self, snapshot: ControllerSnapshot) -> None:
        from vllm_dspark.log import get_logger

        get_logger(__name__).info(snapshot.summary())

    def flush(self) -> None:
        if self.trace is not None:
            self.trace.flush()


def value_sum(hist: list[int]) -> int:
    """Sum of the values counted by a histogram indexed by value."""
    return sum(n * c for n, c in enumerate(hist))


def _mean(hist: list[int]) -> float:
    total = sum(hist)
    return value_sum(hist) / total if total else 0.0
