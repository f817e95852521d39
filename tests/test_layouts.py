"""Checkpoint layouts (layouts.py) and the converter (convert.py), without an
engine: every layout reads to the same description, conversions round-trip
bit for bit, a reduced draft vocabulary is consistent, and every layout that
cannot load is refused with the key that decided it."""

import copy
import json

import pytest

from tests.conftest import DRAFTER_DIR, TARGET_DIR
from vllm_dspark.config import DSparkConfigError
from vllm_dspark.convert import convert, to_native_config
from vllm_dspark.layouts import describe, read_drafter

NATIVE_CFG = json.loads((DRAFTER_DIR / "config.json").read_text())


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _same_weights(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {layout: convert(str(DRAFTER_DIR), str(root / layout), layout, target=str(TARGET_DIR))
            for layout in ("native", "trainer", "speculators")}


def test_every_layout_reads_to_the_same_description(layouts):
    specs = {layout: read_drafter(str(path)) for layout, path in layouts.items()}
    assert {s.layout for s in specs.values()} == set(layouts)
    first = specs["native"]
    for spec in specs.values():
        assert spec.__dict__ | {"layout": "native", "speculative_tokens": None} == first.__dict__
    assert first.target_layer_ids == tuple(NATIVE_CFG["target_layer_ids"])
    cfg = json.loads((layouts["speculators"] / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in NATIVE_CFG["target_layer_ids"]]
    assert "markov_rank" not in json.loads((layouts["trainer"] / "config.json").read_text())  # nested only


def test_conversions_round_trip_bit_for_bit(layouts, tmp_path):
    original = _weights(DRAFTER_DIR)
    trainer = _weights(layouts["trainer"])
    assert "embed_tokens.weight" not in trainer and "lm_head.weight" not in trainer  # shared with the target
    assert _same_weights(_weights(layouts["speculators"]), original)
    for via in ("trainer", "speculators"):
        back = convert(str(layouts[via]), str(tmp_path / f"from_{via}"), "native", target=str(TARGET_DIR))
        assert _same_weights(_weights(back), original), via
        assert json.loads((back / "config.json").read_text()) == to_native_config(NATIVE_CFG, "native"), via


def test_reduced_draft_vocabulary_is_consistent(tmp_path):
    import torch

    out = convert(str(DRAFTER_DIR), str(tmp_path / "reduced"), "speculators", draft_vocab=256)
    spec = read_drafter(str(out))
    assert spec.reduced_vocab and spec.draft_vocab_size == 256 and spec.vocab_size == 2048
    w, full = _weights(out), _weights(DRAFTER_DIR)
    kept = torch.arange(256) + w["d2t"]
    assert bool((kept[1:] > kept[:-1]).all()) and int(kept[-1]) < 2048  # distinct target ids, in id order
    assert int(w["t2d"].sum()) == 256 and bool(w["t2d"][kept].all())
    assert torch.equal(w["lm_head.weight"], full["lm_head.weight"][kept])
    assert torch.equal(w["markov_head.markov_w2.weight"], full["markov_head.markov_w2.weight"][kept])
    assert torch.equal(w["markov_head.markov_w1.weight"], full["markov_head.markov_w1.weight"])  # target ids in
    with pytest.raises(SystemExit, match="already has a reduced draft vocabulary"):
        convert(str(out), str(tmp_path / "again"), "native", draft_vocab=128)


def _speculators_cfg(**top):
    cfg = {"speculators_model_type": "dspark", "block_size": 7, "mask_token_id": 2, "markov_rank": 32,
           "aux_hidden_state_layer_ids": [1, 2, 3], "sample_from_anchor": True,
           "transformer_layer_config": {"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 256}}
    cfg.update(top)
    return {k: v for k, v in cfg.items() if v is not None}


def _trainer_cfg(**nested):
    cfg = copy.deepcopy(NATIVE_CFG)
    cfg["architectures"] = ["DSparkDraftModel"]
    inner = {k: cfg.pop(k) for k in ("mask_token_id", "target_layer_ids", "markov_rank")}
    inner.update(nested)
    cfg["dflash_config"] = {k: v for k, v in inner.items() if v is not None}
    return cfg


REFUSED = {
    "DeepSeek-V4 bundled": ({"architectures": ["DeepseekV4ForCausalLM"], "dspark_block_size": 5,
                             "dspark_noise_token_id": 128799},
                            r"DeepSeek-V4 target with its DSpark drafter bundled.*'dspark_block_size'.*"
                            r"VLLM_USE_V2_MODEL_RUNNER=1"),
    "DFlash": ({"architectures": ["DFlashDraftModel"], "block_size": 16},
               r"a DFlash drafter.*DFlashDraftModel.*method 'dflash'"),
    "speculators EAGLE-3": ({"speculators_model_type": "eagle3"}, r"speculators 'eagle3'.*method 'eagle3'"),
    "Kimi-K3": ({"model_type": "k3_dspark"}, r"Kimi-K3.*model_type='k3_dspark'.*V2 runner"),
    "Gemma-4": ({"architectures": ["Gemma4DSparkModel"]}, r"Gemma-4 DSpark.*Gemma4DSparkModel"),
    "DeepSeek-V4 drafter": ({"architectures": ["DSparkDraftModel"], "model_type": "deepseek_v4"},
                            r"DeepSeek-V4 DSpark drafter.*model_type='deepseek_v4'"),
    "unknown": ({"architectures": ["LlamaForCausalLM"]}, r"not a DSpark checkpoint.*LlamaForCausalLM"),
    "speculators, anchor absent": (_speculators_cfg(sample_from_anchor=None),
                                   r"sample_from_anchor=false \(absent means false in the speculators format\)"),
    "native, anchor false": ({**NATIVE_CFG, "sample_from_anchor": False}, r"native layout.*sample_from_anchor=false"),
    "speculators without backbone": (_speculators_cfg(transformer_layer_config=None), r"no transformer_layer_config"),
    "speculators without layers": (_speculators_cfg(aux_hidden_state_layer_ids=None),
                                   r"lacks 'aux_hidden_state_layer_ids'"),
    "trainer without mask token": (_trainer_cfg(mask_token_id=None),
                                   r"trainer layout.*lacks 'mask_token_id' in dflash_config or at the top level"),
    "trainer disagreeing": ({**_trainer_cfg(), "markov_rank": 16},
                            r"markov_rank=32 in dflash_config but markov_rank=16 at the top level"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_layouts_that_cannot_load_are_refused_by_name(case):
    cfg, pattern = REFUSED[case]
    with pytest.raises(DSparkConfigError, match=pattern):
        describe(cfg, "some/drafter")


def test_other_dspark_keys_do_not_make_a_drafter_bundled():
    """vLLM's own dspark_draft_topk may sit in a native drafter's config."""
    assert describe({**NATIVE_CFG, "dspark_draft_topk": 4}, "x").layout == "native"


def test_trainer_layout_reads_nested_keys():
    spec = describe(_trainer_cfg(), "x")
    assert (spec.layout, spec.mask_token_id, spec.markov_rank) == ("trainer", 2, 32)
    assert spec.target_layer_ids == tuple(NATIVE_CFG["target_layer_ids"])


def test_speculators_layer_ids_and_stated_k():
    spec = describe(_speculators_cfg(speculators_config={"proposal_methods": [{"speculative_tokens": 5}]}), "x")
    assert spec.target_layer_ids == (0, 1, 2) and spec.speculative_tokens == 5


def test_reduced_vocabulary_without_d2t_is_refused(tmp_path):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "model.safetensors").symlink_to(DRAFTER_DIR / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**NATIVE_CFG, "draft_vocab_size": 1024}))
    with pytest.raises(DSparkConfigError, match=r"draft_vocab_size=1024 < vocab_size=2048.*lack \['d2t'\]"):
        read_drafter(str(out))


def test_hub_id_missing_from_an_offline_cache_says_so(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(DSparkConfigError, match=r"hub id.*no config\.json for it and HF_HUB_OFFLINE.*"
                                                r"huggingface-cli download org/drafter"):
        read_drafter("org/drafter")


def _spec_config(drafter, k=None):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    from vllm_dspark.compat.patches import apply_config_patches

    apply_config_patches()  # idempotent; vLLM's plugin loading may not have run in this process
    target = ModelConfig(model=str(TARGET_DIR), dtype="bfloat16", max_model_len=512)
    k_given = {} if k is None else {"num_speculative_tokens": k}
    return SpeculativeConfig(method="dspark", model=str(drafter), target_model_config=target,
                             target_parallel_config=ParallelConfig(), **k_given)


def test_vllm_config_carries_the_description_in_native_keys(layouts, tmp_path):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    for layout, path in layouts.items():
        spec = _spec_config(path, 7)
        hf = spec.draft_model_config.hf_config
        assert spec.draft_model_config.architectures == ["Qwen3DSparkModel"], layout
        assert (hf.markov_rank, hf.mask_token_id, hf.block_size) == (32, 2, 7), layout
        assert hf.dspark_drafter["layout"] == layout
        assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in NATIVE_CFG["target_layer_ids"])
    # Without num_speculative_tokens, K is the checkpoint's own (speculators: its proposal's).
    cfg = json.loads((layouts["speculators"] / "config.json").read_text())
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 5
    out = tmp_path / "k5"
    out.mkdir()
    for f in layouts["speculators"].iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(cfg))
    assert _spec_config(out).num_speculative_tokens == 5
    assert _spec_config(layouts["trainer"]).num_speculative_tokens == 7


def test_kv_share_counts_the_drafter_s_layers_against_the_target_s():
    """The tiny pair: 2 drafter layers and 4 target layers, alike per layer,
    so the drafter takes a third of each token's KV; a config without
    head_dim or KV heads reads them from the attention heads."""
    from types import SimpleNamespace

    from vllm_dspark.layouts import kv_share

    draft, target = (SimpleNamespace(**json.loads((d / "config.json").read_text())) for d in (DRAFTER_DIR, TARGET_DIR))
    assert (draft.num_hidden_layers, target.num_hidden_layers) == (2, 4)
    assert kv_share(draft, target) == pytest.approx(1 / 3)
    mha = SimpleNamespace(num_hidden_layers=1, num_attention_heads=8, hidden_size=512)  # 8 heads of 64
    gqa = SimpleNamespace(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    assert kv_share(mha, gqa) == pytest.approx(512 / (512 + 3 * 128))
