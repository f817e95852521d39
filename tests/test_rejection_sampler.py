"""DSparkRejectionSampler on its own, with vLLM's metadata objects and many draws.

Each batch holds thousands of independent copies of a few request kinds with
different draft lengths (0..3), so one forward() call gives many draws. At
every output position the emitted token must follow the target's processed
distribution, whatever the draft distribution q was.
"""

import math

import pytest
import torch

V = 6
KINDS = [3, 0, 2, 1]  # draft lengths of the request kinds
COPIES = 3000


def _sampling_metadata(temps, top_p=None, top_k=None, generators=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temps)
    temps = torch.tensor(temps, dtype=torch.float32)
    greedy = bool((temps < 1e-5).all())
    return SamplingMetadata(
        temperature=None if greedy else temps,
        all_greedy=greedy,
        all_random=bool((temps >= 1e-5).all()),
        top_p=None if top_p is None else torch.full((n,), top_p),
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _spec_metadata(draft_lists):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    counts = [len(d) for d in draft_lists]
    starts = torch.tensor([0] + counts[:-1]).cumsum(0) + torch.arange(len(counts))
    target = torch.cat([s + torch.arange(n) for s, n in zip(starts.tolist(), counts)]).to(torch.int32)
    bonus = (starts + torch.tensor(counts)).to(torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(draft_lists, []), dtype=torch.int32),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(counts).cumsum(0).to(torch.int32),
        cu_num_sampled_tokens=(torch.tensor(counts) + 1).cumsum(0).to(torch.int32),
        target_logits_indices=target,
        bonus_logits_indices=bonus,
        logits_indices=torch.arange(sum(counts) + len(counts), dtype=torch.int32),
    )


@pytest.fixture(scope="module")
def sampler():
    from vllm.v1.sample.sampler import Sampler

    from vllm_dspark.rejection_sampler import DSparkRejectionSampler

    return DSparkRejectionSampler(Sampler())


def _expected(logits, temp, top_p):
    """The target distribution after temperature and top-p, written out here
    independently of the code under test."""
    p = torch.softmax(logits / temp, dim=-1)
    if top_p is None:
        return p
    order = p.argsort(descending=True)
    keep_sorted = (p[order].cumsum(0) - p[order]) < top_p  # keep until mass reaches top_p
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[keep_sorted]] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = n * probs
    keep = exp >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expd = torch.cat([exp[keep], exp[~keep].sum()[None]])
    obs, expd = obs[expd > 0], expd[expd > 0]
    stat = ((obs - expd) ** 2 / expd).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


@pytest.mark.parametrize(("temp", "top_p"), [(1.0, None), (0.8, 0.9)])
def test_output_follows_target_distribution(sampler, temp, top_p):
    """Seed 1234; 3000 copies of each of 4 request kinds (12000 requests, 6
    (kind, position) cells, up to 3000 draws each). Each cell gets a
    chi-square test; the test fails if any p-value < 1e-3 / 10 (Bonferroni over
    the 10 cells with the bonus positions), i.e. a correct sampler fails it
    with probability < 1e-3."""
    gen = torch.Generator().manual_seed(1234)
    kinds = len(KINDS)
    # target logits per (kind, position incl. bonus), draft probs per (kind, draft position)
    t_logits = [torch.randn(n + 1, V, generator=gen) * 1.5 for n in KINDS]
    q_probs = [torch.softmax(torch.randn(n, V, generator=gen) * 1.5, -1) for n in KINDS]
    draft_lists, logit_rows, q_rows = [], [], []
    for _ in range(COPIES):
        for k in range(kinds):
            n = KINDS[k]
            d = [int(torch.multinomial(q_probs[k][i], 1, generator=gen)) for i in range(n)]
            draft_lists.append(d)
            logit_rows.append(t_logits[k])
            q_rows.append(q_probs[k])
    torch.manual_seed(1234)
    out = sampler(
        _spec_metadata(draft_lists),
        torch.cat([q for q in q_rows if len(q)]),
        torch.cat(logit_rows),
        _sampling_metadata([temp] * len(draft_lists), top_p=top_p),
    ).sampled_token_ids
    pvalues = []
    for k in range(kinds):
        rows = out[k::kinds]
        for pos in range(KINDS[k] + 1):
            tokens = rows[:, pos]
            tokens = tokens[tokens >= 0]
            counts = torch.bincount(tokens.long(), minlength=V).float()
            pvalues.append(_chi2_pvalue(counts, _expected(t_logits[k][pos], temp, top_p)))
    assert min(pvalues) > 1e-3 / len(pvalues), pvalues


def test_greedy_rows_are_exact(sampler):
    """Temperature 0: accept while the draft is the argmax, then the argmax;
    all accepted: the bonus (also the argmax)."""
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0],
                           [5, 0, 0, 0, 0, 0], [0, 0, 0, 0, 5, 0],
                           [0, 0, 0, 0, 0, 5]], dtype=torch.float32)
    drafts = [[1, 2], [3], []]  # request 0: all accepted; 1: rejected at 0; 2: no drafts
    out = sampler(_spec_metadata(drafts), None, logits, _sampling_metadata([0.0] * 3)).sampled_token_ids
    assert out.tolist() == [[1, 2, 3], [0, -1, -1], [5, -1, -1]]


def test_cpu_greedy_path_matches_tensor_path(sampler):
    """All-greedy CPU batches take a list-based path; it must emit what the
    tensor path emits, row for row, with the same accepted counts (random
    batches with empty rows, padded -1 drafts and ties in the logits;
    seed 0, 200 batches)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        counts = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        total = sum(counts)
        if total == 0:
            continue  # forward() never verifies a batch without drafts
        target = torch.randint(0, 3, (total, V), generator=gen).float()  # small ints: many ties
        argmax = target.argmax(-1)
        # Drafts mostly follow the argmax, so long accepted prefixes occur.
        drafts = torch.where(torch.rand(total, generator=gen) < 0.7, argmax,
                             torch.randint(-1, V, (total,), generator=gen)).to(torch.int32)
        bonus = torch.randint(0, V, (len(counts),), generator=gen)
        width = max(counts) + 1
        fast = torch.full((len(counts), width), -1, dtype=torch.int32)
        sampler._verify_greedy(fast, counts, drafts, target, bonus)
        fast_outcome = sampler.last_outcome
        slow = torch.full_like(fast, -1)
        sampler._verify(slow, counts, drafts.long(), None, target, bonus,
                        _sampling_metadata([0.0] * len(counts)))
        assert torch.equal(fast, slow), (counts, fast, slow)
        assert fast_outcome == sampler.last_outcome


def test_invalid_draft_slots_are_rejected(sampler):
    """-1 drafts (vLLM pads new requests with them) never get accepted."""
    logits = torch.zeros(2, V)
    logits[0, 2] = 10.0
    for temp in (1.0, 0.0):
        out = sampler(_spec_metadata([[-1]]), None, logits, _sampling_metadata([temp])).sampled_token_ids
        assert out[0, 0].item() != -1 and out[0, 1].item() == -1
        assert sampler.take_outcome() == ([1], [0]) and sampler.take_outcome() is None  # once per forward
    # The tensor path too, on a greedy row (all-greedy CPU batches take a list path).
    out = torch.full((1, 2), -1, dtype=torch.int32)
    sampler._verify(out, [1], torch.tensor([-1]), None, logits[:1], torch.tensor([3]), _sampling_metadata([0.0]))
    assert out.tolist() == [[2, -1]]


def test_seeded_requests_are_reproducible(sampler):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=gen)
    q = torch.softmax(torch.randn(6, V, generator=gen), -1)
    drafts = [[1, 2, 3], [4, 5, 0]]

    def run():
        gens = {0: torch.Generator().manual_seed(7), 1: torch.Generator().manual_seed(8)}
        md = _sampling_metadata([1.0, 1.0], generators=gens)
        return [sampler(_spec_metadata(drafts), q, logits, md).sampled_token_ids.tolist() for _ in range(5)]

    torch.manual_seed(0)
    first = run()
    torch.manual_seed(99)  # the global RNG must not matter for seeded requests
    assert run() == first
    assert len({str(r) for r in first}) > 1  # ...while successive draws still vary
    assert not math.isnan(float(q.sum()))


def test_synthetic_mode_is_refused_at_construction():
    """vLLM's rejection_sample_method="synthetic" accepts at fixed rates
    whatever the target says: never silently run standard verification."""
    from types import SimpleNamespace

    from vllm.v1.sample.sampler import Sampler

    from vllm_dspark.config import DSparkConfigError
    from vllm_dspark.rejection_sampler import DSparkRejectionSampler

    spec = SimpleNamespace(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.5, 0.2],
                           num_speculative_tokens=3)
    with pytest.raises(DSparkConfigError, match="synthetic"):
        DSparkRejectionSampler(Sampler(), spec, torch.device("cpu"))
