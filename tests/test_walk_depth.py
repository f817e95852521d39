"""The Markov walk stopped at depth d < K drafts exactly the first d
positions of the full walk (tokens, draft probabilities, confidences), so a
block cut at d is the block the full walk would have verified to d."""

from types import SimpleNamespace

import pytest
import torch

from tests.test_rejection_sampler import _sampling_metadata
from vllm_dspark.proposer.dspark_proposer import DSparkProposer

H, E, V, K = 8, 4, 16, 5


class _FakeDSpark:
    """Random linear heads in place of the drafter's (the walk only calls these)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.head = torch.randn(H, V, generator=gen)
        self.emb = torch.randn(V, E, generator=gen)
        self.bias = 3 * torch.randn(E, V, generator=gen)  # strong enough to change the argmax
        conf = torch.randn(H + E, generator=gen)
        self.model = SimpleNamespace(confidence_head=lambda h, e: torch.cat([h, e], -1) @ conf)

    def compute_draft_logits(self, hidden):
        return hidden @ self.head

    def markov_embed(self, ids):
        return self.emb[ids]

    def markov_bias(self, embed):
        return embed @ self.bias


@pytest.mark.parametrize("temps", [[0.0, 0.0, 0.0], [1.0, 0.0, 0.7]])
def test_shallow_walk_is_the_full_walk_cut(temps):
    proposer = object.__new__(DSparkProposer)  # only the walk: no vLLM config needed
    proposer.model = _FakeDSpark()
    hidden = torch.randn(3, K, H, generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([1, 5, 9])
    md = _sampling_metadata(temps)
    torch.manual_seed(2)
    full_tokens, full_probs, full_conf, _, _ = proposer._sample_block(hidden, anchors, md)
    assert (full_tokens[:, 1:] != proposer.model.compute_draft_logits(hidden[:, 1:]).argmax(-1)).any(), \
        "the Markov bias must matter, or a cut walk is trivially the full one"
    for depth in range(1, K + 1):
        torch.manual_seed(2)
        tokens, probs, conf, walk_seconds, walked = proposer._sample_block(hidden, anchors, md, depth)
        assert tokens.shape == full_tokens.shape and conf.shape == full_conf.shape
        assert torch.equal(tokens[:, :depth], full_tokens[:, :depth])
        assert torch.equal(conf[:, :depth], full_conf[:, :depth])
        if full_probs is None:
            assert probs is None
        else:
            assert probs.shape[1] == depth and torch.equal(probs, full_probs[:, :depth])
        # Past the walk: the parallel stage's argmax, still scored (each
        # position from its hidden state and the token before it).
        model = proposer.model
        rest = model.compute_draft_logits(hidden[:, depth:]).argmax(-1)
        assert torch.equal(tokens[:, depth:], rest)
        expected = model.model.confidence_head(hidden[:, depth:], model.markov_embed(tokens[:, depth - 1:K - 1]))
        assert torch.allclose(conf[:, depth:], expected, atol=1e-5)
        assert walk_seconds > 0 and walked == depth


def _with_markov_head(model, scale=1.0, quantized=False):
    """``model`` with a vLLM-shaped Markov head whose bias is ``markov_bias``'s."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    method = object() if quantized else UnquantizedEmbeddingMethod()
    w2 = SimpleNamespace(weight=model.bias.t().contiguous(), tp_size=1, quant_method=method)
    model.model.markov_head = SimpleNamespace(markov_w2=w2)
    model.logits_processor = SimpleNamespace(scale=scale, soft_cap=None, logits_as_input=False)
    return model


@pytest.mark.parametrize("temps", [[0.0, 0.0, 0.0], [1.0, 0.0, 0.7]])
def test_fused_markov_bias_drafts_what_markov_bias_drafts(temps):
    """Where vLLM's markov_bias is a plain product with its weight, the walk
    adds it in one addmm: same tokens, probabilities and confidences (to
    float32 rounding) as calling markov_bias; anything else (a logit scale,
    a quantized head) keeps markov_bias."""
    plain = object.__new__(DSparkProposer)
    plain.model = _FakeDSpark()
    fused = object.__new__(DSparkProposer)
    fused.model = _with_markov_head(_FakeDSpark())
    fused._markov_key = None
    assert fused._markov_matrix(V) is not None
    hidden = torch.randn(3, K, H, generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([1, 5, 9])
    md = _sampling_metadata(temps)
    torch.manual_seed(2)
    want = plain._sample_block(hidden, anchors, md)
    torch.manual_seed(2)
    got = fused._sample_block(hidden, anchors, md)
    assert torch.equal(got[0], want[0])
    assert (want[1] is None) == (got[1] is None)
    if want[1] is not None:
        assert torch.allclose(got[1], want[1], atol=1e-6)
    assert torch.allclose(got[2], want[2], atol=1e-5)
    with torch.inference_mode():  # weights loaded under inference mode keep no version counter
        fused.model.model.markov_head.markov_w2.weight = fused.model.bias.t().clone()
    assert torch.equal(fused._markov_matrix(V), fused.model.bias)
    for kwargs in ({"scale": 2.0}, {"quantized": True}):
        other = object.__new__(DSparkProposer)
        other.model = _with_markov_head(_FakeDSpark(), **kwargs)
        other._markov_key = None
        assert other._markov_matrix(V) is None


def test_a_block_shorter_than_k_is_padded_past_its_walk():
    """A block of d < K positions reaches the runner as K: the later positions
    (never verified) repeat the last token and confidence; a K block is kept."""
    from vllm_dspark.proposer.dspark_proposer import DraftOutput, _padded

    tokens, conf = torch.tensor([[4, 7], [1, 2]]), torch.tensor([[0.5, -1.0], [2.0, 3.0]])
    draft = DraftOutput(tokens, None, conf, 0.1, 2)
    got = _padded(draft, K)
    assert got.tokens.tolist() == [[4, 7, 7, 7, 7], [1, 2, 2, 2, 2]]
    assert got.confidence.tolist() == [[0.5, -1.0, -1.0, -1.0, -1.0], [2.0, 3.0, 3.0, 3.0, 3.0]]
    assert got.depth == 2 and got.walk_seconds == 0.1
    assert _padded(got, K) is got


@pytest.mark.parametrize("sized", [True, False])
def test_the_drafting_cost_counts_the_block_the_walk_needs(sized):
    """With depth-sized blocks a walk d deep is priced at d query positions a
    block (the cost model's token term), else at K."""
    from vllm_dspark.controller.cost_model import CostParams
    from vllm_dspark.controller.costs import StepCosts
    from vllm_dspark.controller.tuning import ControllerTuning

    costs = StepCosts(K, ControllerTuning(), sized_block=sized)
    costs.pin(SimpleNamespace(spec=None, plain=None, draft=CostParams(1e-3, 0.0, 1e-4),
                              walk=CostParams(0.0, 1e-5, 0.0)), "test")
    assert costs.walk_priced()
    for depth in (1, 3, K):
        block = depth if sized else K
        assert costs.draft_seconds(2, depth) == pytest.approx(1e-3 + 1e-4 * 2 * block + depth * 2e-5)
