"""The plain-torch DSpark drafter and the offline verification loop, on a tiny
random pair (fast, no trained weights needed)."""

import pytest
import torch

from vllm_dspark.training.acceptance import speculative_generate, verify_block
from vllm_dspark.training.drafter import DSparkDrafter, build_drafter_config
from vllm_dspark.training.train import block_attention_mask, dspark_loss, target_features

BLOCK = 4


@pytest.fixture(scope="module")
def pair():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    target = Qwen3ForCausalLM(cfg).eval()
    dcfg = build_drafter_config(cfg, num_layers=1, block_size=BLOCK, target_layer_ids=[0, 1],
                                mask_token_id=63, markov_rank=8)
    drafter = DSparkDrafter(dcfg)
    drafter.copy_frozen_from_target(target)
    return target, drafter.eval()


def test_training_blocks_match_inference_blocks(pair):
    """A block packed into a training sequence (anchor-bounded mask) computes
    exactly what inference computes from the context before its anchor."""
    target, drafter = pair
    x = torch.randint(0, 62, (1, 20))
    feats, _ = target_features(target, x, drafter.config.target_layer_ids)
    anchors = torch.tensor([[0, 5, 13]])
    pos = (anchors[..., None] + torch.arange(BLOCK)).view(1, -1)
    ids = torch.full_like(pos, drafter.config.mask_token_id).view(1, 3, BLOCK)
    ids[..., 0] = x[0, anchors[0]]
    mask = block_attention_mask(anchors, 20, BLOCK)
    packed = drafter.backbone(feats, torch.arange(20)[None], ids.view(1, -1), pos, mask).view(3, BLOCK, -1)
    for b, a in enumerate(anchors[0].tolist()):
        mask_one = torch.ones(1, BLOCK, a + BLOCK, dtype=torch.bool)
        alone = drafter.backbone(feats[:, :a], torch.arange(a)[None], ids[:, b], pos.view(3, BLOCK)[b][None], mask_one)
        torch.testing.assert_close(packed[b], alone[0], rtol=1e-5, atol=1e-5)


def test_loss_trains_heads_and_keeps_embeddings_frozen(pair):
    target, drafter = pair
    drafter.train()
    x = torch.randint(0, 62, (2, 24))
    loss, metrics = dspark_loss(drafter, target, x, n_anchors=4, gen=torch.Generator().manual_seed(0))
    loss.backward()
    drafter.eval()
    assert torch.isfinite(loss) and 1 <= metrics["tau_est"] <= BLOCK + 1
    for name in ("fc.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight", "layers.0.self_attn.k_proj.weight"):
        grad = dict(drafter.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None
    drafter.zero_grad(set_to_none=True)


def test_greedy_speculation_is_identical_to_greedy(pair):
    from vllm_dspark.training.acceptance import greedy_generate

    target, drafter = pair
    for seed in range(3):
        prompt = torch.randint(0, 62, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        out, rounds = speculative_generate(target, drafter, prompt, 24, 0.0, None)
        assert out == greedy_generate(target, prompt, 24)
        assert all(0 <= r["accepted"] <= BLOCK for r in rounds)


def test_verify_block_greedy_stops_at_first_mismatch():
    logits = torch.full((4, 5), -5.0)
    logits[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 5.0  # target argmaxes 1,2,3,4
    assert verify_block(torch.tensor([1, 2, 0]), None, logits, 0.0, None) == (2, 3)
    assert verify_block(torch.tensor([1, 2, 3]), None, logits, 0.0, None) == (3, 4)


def test_verify_block_samples_the_target_distribution():
    """First committed token ~ p whatever q is. Seed 0, 20000 draws, chi-square
    with 3 dof at alpha = 1e-3 (critical value 16.27): a correct sampler fails
    this with probability 0.001."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = p.log().expand(2, 4)
    counts = torch.zeros(4)
    draws = 20000
    for _ in range(draws):
        x = torch.multinomial(q, 1, generator=gen)
        n, nxt = verify_block(x, q[None], logits, 1.0, gen)
        counts[int(x) if n == 1 else nxt] += 1
    chi2 = ((counts - draws * p) ** 2 / (draws * p)).sum().item()
    assert chi2 < 16.27, (chi2, counts)
