"""Every tuned number of the controller, in one place.

Each field says in one line what it trades; docs/tuning.md has, per field, the
evidence that set it (commit and run file) and what to re-measure before
changing it. Tests build the tuning they need (``ControllerTuning(probe_every=4)``)
instead of patching module globals. Nothing here is a user knob: those are
``DSparkKnobs`` (config.py).
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostModelTuning:
    """The online step-time models (cost_model.py)."""

    forgetting: float = 0.99  # per step; older steps fade over ~1/(1-x) steps: lower follows shifts faster, noisier
    prior: tuple[float, float, float] = (5e-3, 1e-4, 0.0)  # t0, t_req, t_tok (s) before any step: verifying is free
    prior_weight: float = 0.01  # ridge pull toward the prior, in observations per coefficient
    feature_scale: tuple[float, float, float] = (1.0, 8.0, 64.0)  # features [1, R/8, B/64]: what the ridge resolves
    outlier_ratio: float = 4.0  # a step this many times its prediction is a stall: scored, not fitted, charged that bound
    min_observations: int = 20  # a model is trusted (and screened for stalls) after this many steps
    error_window: int = 500  # steps the reported prediction error covers
    refit_warmup: int = 64  # refit after every step while the steps seen weigh less than this (decayed)...
    refit_every: int = 8  # ...then every this many (the statistics take in every step)


@dataclass(frozen=True)
class CalibrationTuning:
    """The per-position Platt calibration of the confidence head (calibration.py)."""

    refit_every: int = 20  # observed steps between fits: fresher against ~0.7 ms a fit on CPU
    decay: float = 0.999  # per observed step: how long old outcomes count
    ridge: float = 1e-2  # keeps the 2x2 Newton system posed before data arrives
    z_min: float = -12.0  # raw-logit range of the binned statistics...
    z_max: float = 12.0
    z_bin: float = 0.25  # ...and bin width (well inside the fit's own noise)
    min_weight: float = 10.0  # outcome weight a position needs before it is refitted
    newton_iters: int = 8  # at most this many Newton steps per fit...
    newton_tol: float = 1e-4  # ...stopping once no parameter moves more than this
    param_bound: float = 20.0  # |alpha|, |beta| cap; alpha >= 0 keeps the head's ranking
    ece_bins: int = 10  # bins of the reported calibration error


@dataclass(frozen=True)
class SurvivalTuning:
    """The skip rule's window of recent blocks (survival.py)."""

    window: int = 128  # blocks kept: more is steadier, slower to turn over
    refresh_every: int = 8  # estimates between recomputations once something changed
    min_expected: float = 20.0  # expected tokens among verified blocks before the accepted/expected ratio counts
    half_life_steps: float = 128.0  # engine steps for a block's weight to halve: the last few probes decide


@dataclass(frozen=True)
class ControllerTuning:
    """The controller's rules (clock, costs, gate, dormancy, adaptive policy)."""

    # Step clock (clock.py)
    max_engine_gap_s: float = 0.05  # a longer gap between steps is idle time, charged as that kind's usual gap
    gap_ema: float = 0.9  # smoothing of the usual gap after a plain and after a verify step
    # Step costs (costs.py)
    overhead_ema: float = 0.9  # smoothing of the verify path's overhead, the bridge between the two step models
    save_every_steps: int = 500  # recorded steps between saves of the learned costs
    # Drafting gate (gate.py)
    probe_every: int = 8  # skipped steps per probe before drafting is measured, and the shortest gap after
    max_probe_every: int = 1024  # the longest gap between probes
    probe_loss_budget: float = 0.005  # throughput probes may give up, paced by their predicted loss
    explore_every: int = 256  # drafting steps between plain ones that keep the plain step measured
    price_steps: int = 3  # decode steps without drafts after each explore skip, capping the price (drift.py): more caps sooner, each gives up a drafting step
    cruise_every: int = 8  # drafting steps per full rule while the batch and its verdict hold: fewer reacts sooner, costs more
    # Adaptive lengths (policies.py)
    vary_lengths_every: int = 32  # drafting steps per length shift while the per-token cost is unidentified
    vary_shift: int = 3  # the shift's range, -x..x tokens per request
    min_token_spread: float = 0.1  # relative spread of verified tokens below which the shifts run and the plain slope prices a token
    # Dormancy (dormancy.py)
    dormant_skip_share: float = 0.9  # share of recent steps that skipped drafting before dormancy
    dormant_recheck_every: int = 8  # steps between full checks while dormant, at first
    dormant_recheck_max: int = 64  # the longest gap, reached as checks keep finding no pay: wakes later, costs less
    dormant_exit_checks: int = 2  # paying checks in a row that end dormancy
    dormant_record_every: int = 4  # dormant plain steps (not coasting) per one recorded into the cost models
    # Exploration budget (budget.py)
    budget_share: float = 0.01  # of no-speculation time that exploring may give up, measured
    budget_cap_steps: float = 64.0  # the most the balance holds, in plain steps: full, it re-tests a no-draft verdict
    episode_tokens: float = 32.0  # decoded tokens' worth the balance must hold before a speculating episode starts
    budget_warmup_steps: int = 8  # plain steps the nospec model sees before steps are priced
    price_warmup_steps: int = 256  # the most plain steps a fresh engine's first requests keep out of the nospec models
    budget_unpriced_steps: int = 16  # speculating steps in a row at an unmeasured batch size that end an episode
    budget_price_age_steps: int = 2048  # speculating steps a no-spec price holds: longer risks drift, shorter costs context
    marked_steps: int = 4  # priced steps at a batch size where an episode lost a reserve unearned back, before a net loss there ends the next: fewer ends sooner, on noisier evidence
    trial_steps: int = 32  # drafting steps an exploring episode takes whatever the models say: what it learns from
    # Machine pace (pace.py)
    pace_every_steps: int = 8  # the fewest steps between canaries: fewer follows drift sooner, costs more
    pace_share: float = 0.001  # the most of the steps' time the canary may take (spaced out to keep within it)
    pace_window: int = 9  # canaries in the median: more is steadier, slower to follow a spell
    pace_fit_decay: float = 0.98  # per canary, in the fit of canary against steps: ~50 canaries count
    pace_min_fits: int = 16  # canaries set against steps before the canary prices at all
    pace_clip: float = 0.4  # log distance from the window's median a canary counts up to: a stray reading cut
    # Drift within an episode (drift.py)
    drift_window: int = 32  # verify steps per median: more is steadier, slower to follow a spell
    drift_shape_steps: int = 8  # steps of each shape that set its reference time
    drift_clip: float = 2.0  # the most the price falls with the episode's drift (it never rises)
    trial_price_at: int = 16  # a trial's drafting steps before its explore skip and price steps: sooner floors its price sooner
    awake_probe_every: int = 256  # dormant steps between probes of the awake step once measured: fewer follows drift sooner, costs more
    awake_probe_window: int = 8  # probes in the awake share's estimate: more is steadier, slower to start (0: none)
    awake_wait_steps: int = 128  # engine steps episodes may wait for the awake share, from the first held off: more floors more first trials, explores later (0: none)
    # Start-up (runner.py)
    warm_up_requests: int = 4  # verify token counts of batches up to this many requests run once before serving: more start-up time, fewer first runs in trials
    cost: CostModelTuning = field(default_factory=CostModelTuning)
    calibration: CalibrationTuning = field(default_factory=CalibrationTuning)
    survival: SurvivalTuning = field(default_factory=SurvivalTuning)
