"""Environment variables of vllm_dspark (all prefixed ``VLLM_DSPARK_``).

Read lazily on attribute access so that tests and users can change them after
import, like ``vllm.envs``. This is the only module that reads os.environ.
"""

import os
from collections.abc import Callable
from typing import Any


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            return default
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean; use 1 or 0.")

    return read


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name, "").strip().lower() or default
        if value not in choices:
            raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}.")
        return value

    return read


# name -> (reader, one-line documentation shown in the README)
ENV_VARS: dict[str, tuple[Callable[[], Any], str]] = {
    "VLLM_DSPARK_ENABLED": (
        _flag("VLLM_DSPARK_ENABLED", True),
        "Set to 0 to make the plugin a no-op (vLLM's own VLLM_PLUGINS "
        "allow-list works too).",
    ),
    "VLLM_DSPARK_SKIP_VERSION_CHECK": (
        _flag("VLLM_DSPARK_SKIP_VERSION_CHECK", False),
        "Set to 1 to run against a vLLM other than the pinned one (unsupported).",
    ),
    "VLLM_DSPARK_CACHE_DIR": (
        lambda: os.path.expanduser(os.environ.get("VLLM_DSPARK_CACHE_DIR", "~/.cache/vllm_dspark")),
        "Where learned step-time models are saved (one JSON per hardware/model fingerprint).",
    ),
    "VLLM_DSPARK_TRACE_DIR": (
        lambda: os.environ.get("VLLM_DSPARK_TRACE_DIR") or None,
        "Record controller traces for the simulator into this folder (same as the "
        "trace_dir knob; off when unset).",
    ),
    "VLLM_DSPARK_TEST_CLOCK_SKEW_S": (
        lambda: float(os.environ.get("VLLM_DSPARK_TEST_CLOCK_SKEW_S") or 0.0),
        "Tests only: skew the controller's step clock on tensor-parallel ranks other "
        "than 0 by this many seconds per reading (the ranks must still agree).",
    ),
    "VLLM_DSPARK_OPS": (
        _choice("VLLM_DSPARK_OPS", "auto", ("auto", "triton", "reference")),
        "Kernel choice: auto (Triton on CUDA tensors, torch twin elsewhere), "
        "triton, or reference (always the torch twin).",
    ),
}


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return ENV_VARS[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(ENV_VARS)
