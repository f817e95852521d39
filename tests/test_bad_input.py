"""Every bad DSpark setting fails at start-up (LLM() construction, before any
engine process starts) with a message that names the field and the fix."""

import json
import shutil

import pytest

from tests.conftest import DRAFTER_DIR, TARGET_DIR
from vllm_dspark.benchmarking import KV_CACHE_BYTES


def _llm(spec=None, additional=None):
    from vllm import LLM

    spec_config = {"method": "dspark", "model": str(DRAFTER_DIR), "num_speculative_tokens": 7, **(spec or {})}
    return LLM(model=str(TARGET_DIR), dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=KV_CACHE_BYTES,
               enforce_eager=True, speculative_config=spec_config,
               additional_config={"dspark": additional} if additional is not None else {})


def _drafter_copy(tmp_path, **overrides):
    out = tmp_path / "drafter"
    out.mkdir()
    for f in DRAFTER_DIR.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((DRAFTER_DIR / "config.json").read_text())
    cfg.update(overrides)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _curve_file(tmp, text):
    path = tmp / "curve.json"
    path.write_text(text)
    return {"cost_curve": str(path)}


CASES = {
    "missing path": (lambda tmp: {"model": str(tmp / "nope")}, None,
                     r"speculative_config\.model=.*does not exist"),
    "not a DSpark checkpoint": (lambda tmp: {"model": str(TARGET_DIR)}, None,
                                r"not a DSpark checkpoint.*Qwen3ForCausalLM"),
    "folder without config.json": (lambda tmp: {"model": str(tmp)}, None, r"has no config\.json"),
    "DeepSeek-V4 bundled layout": (lambda tmp: {"model": _drafter_copy(
        tmp, architectures=["DeepseekV4ForCausalLM"], dspark_block_size=5)}, None,
                                   r"DeepSeek-V4 target with its DSpark drafter bundled.*'dspark_block_size'"),
    "anchor-less blocks": (lambda tmp: {"model": _drafter_copy(tmp, sample_from_anchor=False)}, None,
                           r"sample_from_anchor=false.*1\+N layout"),
    "reduced vocabulary without d2t": (lambda tmp: {"model": _drafter_copy(tmp, draft_vocab_size=1024)}, None,
                                       r"draft_vocab_size=1024 < vocab_size=2048.*lack \['d2t'\]"),
    "synthetic verification": (lambda tmp: {"rejection_sample_method": "synthetic",
                                            "synthetic_acceptance_rates": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]},
                               None, r"rejection_sample_method='synthetic' is not supported with method='dspark'"),
    "vocab mismatch": (lambda tmp: {"model": _drafter_copy(tmp, vocab_size=4096)}, None,
                       r"vocab_size=4096 but the target has 2048"),
    "hidden size mismatch": (lambda tmp: {"model": _drafter_copy(tmp, target_hidden_size=512)}, None,
                             r"target hidden size 512 but the target has hidden_size=256"),
    "layer ids out of range": (lambda tmp: {"model": _drafter_copy(tmp, target_layer_ids=[0, 2, 7])}, None,
                               r"target_layer_ids=\[0, 2, 7\].*within \[-1, 3\]"),
    "K above block_size": (lambda tmp: {"num_speculative_tokens": 8}, None,
                           r"num_speculative_tokens=8 is out of range.*1\.\.7"),
    "K below 1": (lambda tmp: {"num_speculative_tokens": 0}, None, r"num_speculative_tokens"),
    "unknown knob": (lambda tmp: {}, {"polcy": "full"},
                     r"unknown key 'polcy'; valid keys are: policy, threshold, slo_tokens_per_s"),
    "threshold out of range": (lambda tmp: {}, {"threshold": 1.5},
                               r"threshold: Input should be less than or equal to 1"),
    "unknown policy": (lambda tmp: {}, {"policy": "sometimes"},
                       r"policy: Input should be 'adaptive', 'full' or 'threshold'"),
    "negative SLO": (lambda tmp: {}, {"slo_tokens_per_s": -5}, r"slo_tokens_per_s: Input should be greater than 0"),
    "knobs not an object": (lambda tmp: {}, "fast", r'additional_config\["dspark"\] must be a JSON object'),
    "cost curve missing": (lambda tmp: {}, lambda tmp: {"cost_curve": str(tmp / "nope.json")},
                           r"cost_curve: .*nope\.json' is not a file.*drop the key"),
    "cost curve not JSON": (lambda tmp: {}, lambda tmp: _curve_file(tmp, "{t0: 1"),
                            r"cost_curve: .*is not valid JSON"),
    "cost curve negative": (lambda tmp: {}, lambda tmp: _curve_file(
        tmp, '{"spec": {"t0": 0.005, "t_req": 0, "t_tok": -1}}'), r'cost_curve: .*"spec\.t_tok" must be a finite number >= 0'),
    "cost curve missing key": (lambda tmp: {}, lambda tmp: _curve_file(tmp, '{"spec": {"t0": 0.005}}'),
                               r'cost_curve: .*"spec" must be an object with exactly the keys'),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_at_startup_with_a_clear_error(case, tmp_path):
    spec, knobs, pattern = CASES[case]
    with pytest.raises(Exception, match=pattern):
        _llm(spec(tmp_path), knobs(tmp_path) if callable(knobs) else knobs)


def test_error_for_missing_drafter_is_ours(tmp_path):
    """Not a hub lookup or a deep stack: our own error type, raised up front."""
    from vllm_dspark.config import DSparkConfigError

    with pytest.raises((DSparkConfigError, ValueError)) as info:
        _llm({"model": str(tmp_path / "missing" / "drafter")})
    assert "DSpark drafter folder" in str(info.value)
    shutil.rmtree(tmp_path, ignore_errors=True)
