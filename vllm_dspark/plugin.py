"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` once in every process it starts (frontend,
engine core, each worker; see ``vllm.plugins.load_general_plugins``), and a
process may import us more than once, so the function is idempotent and keeps
its imports inside the body.
"""

import os
import threading
from typing import Any

_lock = threading.Lock()
_state: dict[str, Any] = {"registered": False, "calls": 0, "vllm_version": None}


def register() -> None:
    """Gate on the environment, check the pinned vLLM, then install hooks."""
    from vllm_dspark import envs

    with _lock:
        _state["calls"] += 1
        if _state["registered"]:
            return
        if not envs.VLLM_DSPARK_ENABLED:
            _logger().info("vllm_dspark is disabled by VLLM_DSPARK_ENABLED=0.")
            return

        from vllm_dspark.version import check_vllm_version, installed_vllm_version

        if envs.VLLM_DSPARK_SKIP_VERSION_CHECK:
            version = installed_vllm_version()
        else:
            version = check_vllm_version()
        from vllm_dspark.compat.ledger import check_hooks
        from vllm_dspark.compat.patches import apply_config_patches

        check_hooks("config")
        apply_config_patches()
        _state.update(registered=True, vllm_version=version, pid=os.getpid())
        _logger().info(
            "vllm_dspark registered in pid %d (vLLM %s).", os.getpid(), version
        )


def registration_info() -> dict[str, Any]:
    """What :func:`register` did in this process (for tests and diagnostics)."""
    return {**_state, "pid": os.getpid()}


def _logger():
    from vllm_dspark.log import get_logger

    return get_logger("plugin")
