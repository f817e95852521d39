"""vLLM's own config code reads the committed drafter as a Qwen3 DSpark draft
(offline, no engine). Loading it into a running engine is the proposer's job."""

import pytest

from tests.conftest import DRAFTER_DIR, TARGET_DIR


@pytest.fixture(scope="module")
def spec_config():
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target = ModelConfig(model=str(TARGET_DIR), dtype="bfloat16", max_model_len=512)
    return SpeculativeConfig(method="dspark", model=str(DRAFTER_DIR), target_model_config=target,
                             target_parallel_config=ParallelConfig())


def test_vllm_parses_drafter_as_dspark(spec_config):
    draft = spec_config.draft_model_config
    assert spec_config.method == "dspark"
    assert draft.architectures == ["Qwen3DSparkModel"]
    # vLLM takes K from the checkpoint's block_size when it is not given.
    assert spec_config.num_speculative_tokens == draft.hf_config.block_size == 7
    assert draft.hf_config.markov_rank > 0 and draft.hf_config.enable_confidence_head


def test_vllm_maps_target_layers_to_aux_layers(spec_config):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    ids = spec_config.draft_model_config.hf_config.target_layer_ids
    # vLLM captures the input of layer i+1, i.e. the output of layer i.
    assert get_eagle3_aux_layers_from_config(spec_config) == tuple(i + 1 for i in ids)


def test_vllm_model_registry_knows_the_architecture():
    from vllm.model_executor.models.registry import ModelRegistry

    assert "Qwen3DSparkModel" in ModelRegistry.get_supported_archs()
