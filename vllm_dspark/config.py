"""User-facing configuration: the ``dspark`` knobs (the drafter checkpoint: layouts.py).

Knobs live in vLLM's ``additional_config`` under the key ``"dspark"``::

    LLM(..., additional_config={"dspark": {"policy": "threshold", "threshold": 0.4}})
    vllm serve ... --additional-config '{"dspark": {"policy": "full"}}'

Every check here runs at engine start-up, and every error names the field and
the fix.
"""

import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ADDITIONAL_CONFIG_KEY = "dspark"


class DSparkConfigError(ValueError):
    """A DSpark setting or checkpoint is unusable; the message says how to fix it."""


SYNTHETIC_REFUSED = (
    "speculative_config.rejection_sample_method='synthetic' is not supported with method='dspark': "
    "it accepts drafts at fixed rates, whatever the target says, so output is not the target's and "
    "the controller would learn its acceptance from made-up outcomes. Drop rejection_sample_method "
    "(or set it to 'standard'); DSpark always verifies losslessly."
)


def refuse_synthetic(spec_config) -> None:
    """vLLM's synthetic verification has no place under method='dspark'."""
    if getattr(spec_config, "rejection_sample_method", None) == "synthetic":
        raise DSparkConfigError(SYNTHETIC_REFUSED)


# SamplingParams.extra_args key: a request's own cap on verified drafts (0..K).
MAX_VERIFY_KEY = "dspark_max_verify"


class DSparkKnobs(BaseModel):
    """``additional_config["dspark"]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["adaptive", "full", "threshold"] = Field(
        default="adaptive",
        description='"adaptive" picks per-request verify lengths that maximise expected '
        'goodput under the current load; "full" verifies every drafted token; "threshold" '
        "verifies the longest prefix whose cumulative confidence is at least `threshold`.",
    )
    threshold: float = Field(
        default=0.5, ge=0.0, le=1.0,
        description="Cut-off on the cumulative confidence for policy=threshold.",
    )
    slo_tokens_per_s: float | None = Field(
        default=None, gt=0.0,
        description="policy=adaptive: a per-request floor. The predicted step time is kept "
        "at or below 1/slo_tokens_per_s, so every running request gets at least that rate "
        "even if every draft is rejected; throughput is maximised within that.",
    )
    calibration: bool = Field(
        default=True,
        description="Calibrate the confidence head per position, online, from observed acceptance.",
    )
    persist_cost_model: bool = Field(
        default=True,
        description="Save the learned step-time model under a hardware/model fingerprint "
        "(in VLLM_DSPARK_CACHE_DIR) and reuse it next time.",
    )
    dormant_after_steps: int = Field(
        default=64, ge=0,
        description="policy=adaptive: once drafting was skipped on at least 90% of the last this many "
        "steps and would not pay now, or once the exploration budget is spent (and from the first step "
        "until it can price speculation), the controller is dormant: steps run as vLLM's steps without "
        "speculation (eager, non-hybrid targets) and requests admitted meanwhile keep no drafter "
        "context, which makes the engine about as cheap as one without speculation. It ends when the "
        "budget affords an episode of speculation. 0: never dormant, no budget.",
    )
    adaptive_depth: bool = Field(
        default=True,
        description="policy=adaptive: let the controller stop the Markov head's walk short of K "
        "positions on steps where the later positions would not pay for their walk and "
        "verification (priced by an online model of one position's walk). false: always walk K.",
    )
    depth_sized_block: bool = Field(
        default=True,
        description="policy=adaptive: a step that walks d < K positions also runs the drafter's "
        "parallel stage on a block of d positions (its forward, logits and confidence head shrink "
        "with it). false: always a block of K positions.",
    )
    log_every: int = Field(
        default=0, ge=0,
        description="Log a controller summary every N steps (0: quiet).",
    )
    cost_curve: str | None = Field(
        default=None,
        description="Path to a JSON step-cost curve (format: vllm_dspark/controller/cost_curve.py) "
        "that policy=adaptive uses instead of learning the costs online: for a GPU profiled once, or "
        "to make choices independent of the machine's speed.",
    )

    trace_dir: str | None = Field(
        default=None,
        description="Record a controller trace (confidences, verified and accepted lengths, step "
        "times) as JSON lines in this folder, for `python -m vllm_dspark.sim` (also VLLM_DSPARK_TRACE_DIR).",
    )

    @field_validator("cost_curve")
    @classmethod
    def _curve_loads(cls, path: str | None) -> str | None:
        if path is not None:
            from vllm_dspark.controller.cost_curve import load_cost_curve

            load_cost_curve(path)  # its ValueError names what is wrong
        return path

    def pinned_curve(self):
        """The cost_curve file, read (once per process and file version)."""
        from vllm_dspark.controller.cost_curve import load_cost_curve

        return load_cost_curve(self.cost_curve) if self.cost_curve else None

    def trace_folder(self) -> str | None:
        """Where to trace: the knob, else VLLM_DSPARK_TRACE_DIR (None: off)."""
        from vllm_dspark import envs

        return self.trace_dir or envs.VLLM_DSPARK_TRACE_DIR


def parse_knobs(additional_config: Any) -> DSparkKnobs:
    """Validate ``additional_config["dspark"]`` (absent means defaults)."""
    raw = additional_config.get(ADDITIONAL_CONFIG_KEY, {}) if isinstance(additional_config, dict) else {}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise DSparkConfigError(
            f'additional_config["{ADDITIONAL_CONFIG_KEY}"] must be a JSON object, '
            f"got {type(raw).__name__}: {raw!r}."
        )
    try:
        key = json.dumps(raw, sort_keys=True)
    except (TypeError, ValueError):
        return _parse(raw)
    return _parse_cached(key)


@functools.lru_cache(maxsize=16)
def _parse_cached(key: str) -> DSparkKnobs:
    """One parse per process for the same settings (the front end and the
    worker share a process with the uni executor); the cost curve's own read
    is cached per file version."""
    return _parse(json.loads(key))


def _parse(raw: dict) -> DSparkKnobs:
    valid = ", ".join(DSparkKnobs.model_fields)
    try:
        return DSparkKnobs(**raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "<root>"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown key {field!r}; valid keys are: {valid}")
            else:
                problems.append(f"{field}: {err['msg']} (got {err.get('input')!r})")
                if field == "cost_curve":
                    problems[-1] += "; fix the file or drop the key to learn costs online"
        raise DSparkConfigError(
            f'Invalid additional_config["{ADDITIONAL_CONFIG_KEY}"]: ' + "; ".join(problems) + "."
        ) from None


def _values(info) -> str:
    """A knob's accepted values, from its annotation and bounds."""
    import types
    import typing

    ann = info.annotation
    args = typing.get_args(ann)
    nullable = type(None) in args
    base = next((a for a in args if a is not type(None)), ann) if isinstance(ann, types.UnionType) else ann
    if typing.get_origin(base) is Literal:
        text = ", ".join(f'`"{v}"`' for v in typing.get_args(base))
    else:
        text = {bool: "bool", int: "int", float: "float", str: "path"}.get(base, str(base))
        bounds = []
        for m in info.metadata:
            for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                if getattr(m, attr, None) is not None:
                    bounds.append(f"{sign} {getattr(m, attr)}")
        if bounds:
            text += " " + ", ".join(bounds)
    return text + (" or null" if nullable else "")


def knob_table() -> str:
    """The knobs as the README shows them (`python -m vllm_dspark.config`)."""
    rows = ["| key | values | default | effect |", "|---|---|---|---|"]
    for name, info in DSparkKnobs.model_fields.items():
        default = "null" if info.default is None else json.dumps(info.default)
        rows.append(f"| `{name}` | {_values(info)} | `{default}` | {info.description} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(knob_table())
