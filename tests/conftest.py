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
