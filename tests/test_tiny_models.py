"""The committed tiny pair: format, size, and that the target really learned."""

import json

import pytest
import torch

from tests.conftest import DRAFTER_DIR, MODELS, TARGET_DIR

SIZE_LIMIT_BYTES = 8 * 1024 * 1024
REQUIRED_DRAFT_KEYS = {
    "block_size": 7,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "architectures": ["Qwen3DSparkModel"],
}


def _config(path):
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("folder", [TARGET_DIR, DRAFTER_DIR])
def test_model_folder_under_size_limit(folder):
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    assert 0 < size <= SIZE_LIMIT_BYTES, f"{folder.name} is {size / 2**20:.2f} MiB"


def test_drafter_config_keys():
    cfg, tgt = _config(DRAFTER_DIR), _config(TARGET_DIR)
    for key, value in REQUIRED_DRAFT_KEYS.items():
        assert cfg[key] == value, key
    assert cfg["markov_rank"] > 0
    assert cfg["vocab_size"] == tgt["vocab_size"] and cfg["hidden_size"] == tgt["hidden_size"]
    ids = cfg["target_layer_ids"]
    # strictly increasing, inside the target, never its final layer (post-norm in HF)
    assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < tgt["num_hidden_layers"] - 1
    assert 0 <= cfg["mask_token_id"] < cfg["vocab_size"]


def test_drafter_weight_names_and_shapes():
    from safetensors import safe_open

    cfg = _config(DRAFTER_DIR)
    h, v, r, n = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"], len(cfg["target_layer_ids"])
    with safe_open(str(DRAFTER_DIR / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["fc.weight"] == (h, n * h)
    assert shapes["hidden_norm.weight"] == (h,) and shapes["norm.weight"] == (h,)
    assert shapes["markov_head.markov_w1.weight"] == (v, r)
    assert shapes["markov_head.markov_w2.weight"] == (v, r)
    assert shapes["confidence_head.proj.weight"] == (1, h + r)
    assert shapes["confidence_head.proj.bias"] == (1,)
    layers = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    assert layers == {str(i) for i in range(cfg["num_hidden_layers"])}
    assert all(k.split(".")[0] in {"layers", "fc", "hidden_norm", "norm", "markov_head",
                                   "confidence_head", "embed_tokens", "lm_head"} for k in shapes)


def test_tokenizer_shared_and_has_mask_token():
    from transformers import AutoTokenizer

    t_tok = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    d_tok = AutoTokenizer.from_pretrained(str(DRAFTER_DIR))
    assert t_tok.get_vocab() == d_tok.get_vocab()
    assert len(t_tok) == _config(TARGET_DIR)["vocab_size"]
    assert t_tok.convert_tokens_to_ids("<|mask|>") == _config(DRAFTER_DIR)["mask_token_id"]
    text = "def f(x):\n    return x + 1  # prose, too."
    assert t_tok.decode(t_tok(text)["input_ids"]) == text


def test_target_beats_unigram_on_heldout_text(heldout_prompts):
    """A real LM: its held-out loss is far below a unigram model's."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    model = Qwen3ForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()
    report = json.loads((DRAFTER_DIR / "training_report.json").read_text())
    ids = [tok(p["text"])["input_ids"] for p in heldout_prompts[:32]]
    n = min(map(len, ids))
    x = torch.tensor([i[:n] for i in ids])
    with torch.no_grad():
        logits = model(x).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
    assert loss < report["unigram_heldout_loss"] - 1.5, (loss, report)
    assert report["target_heldout_loss"] < report["unigram_heldout_loss"] - 1.5


def test_drafter_loads_into_torch_reference():
    from vllm_dspark.training.acceptance import load_pair

    target, drafter, _ = load_pair(str(TARGET_DIR), str(DRAFTER_DIR))  # strict: raises on mismatch
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight.float(), rtol=0, atol=1e-2)


def test_prompt_file_has_both_kinds(heldout_prompts):
    kinds = {p["kind"] for p in heldout_prompts}
    assert kinds == {"code", "prose"} and len(heldout_prompts) >= 64
    assert (MODELS.parent / "prompts" / "heldout.jsonl").is_file()
