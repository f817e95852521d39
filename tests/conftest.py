from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "examples" / "models"
TARGET_DIR = MODELS / "tiny-qwen3"
DRAFTER_DIR = MODELS / "tiny-qwen3-dspark"


@pytest.fixture(scope="session")
def heldout_prompts() -> list[dict]:
    from vllm_dspark.training.prompts import load_prompts

    return load_prompts()


@pytest.fixture(scope="session", autouse=True)
def fresh_cost_cache(tmp_path_factory):
    """Engines in the suite learn their step costs from scratch: costs saved
    by earlier runs on this machine (VLLM_DSPARK_CACHE_DIR, ~/.cache by
    default) must not change what a test sees."""
    import os

    old = os.environ.get("VLLM_DSPARK_CACHE_DIR")
    os.environ["VLLM_DSPARK_CACHE_DIR"] = str(tmp_path_factory.mktemp("dspark_cost_cache"))
    yield
    if old is None:
        os.environ.pop("VLLM_DSPARK_CACHE_DIR", None)
    else:
        os.environ["VLLM_DSPARK_CACHE_DIR"] = old
