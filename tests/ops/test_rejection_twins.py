"""Torch twins of the rejection-sampling ops: exact semantics and statistics."""

import torch

from vllm_dspark.ops.reference import rejection_accept, sample_recovered


def test_accept_greedy_and_random_rows():
    # request 0: greedy, 3 drafts, mismatch at index 1; request 1: random, 2 drafts;
    # request 2: no drafts; request 3: random, 1 draft with q one-hot (q=1).
    draft = torch.tensor([5, 6, 7, 1, 2, 9])
    argmax = torch.tensor([5, 0, 7, 0, 0, 0])
    p = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.2, 0.3])
    q = torch.tensor([1.0, 1.0, 1.0, 0.25, 0.4, 1.0])
    u = torch.tensor([0.9, 0.9, 0.9, 0.99, 0.6, 0.29])
    cu = torch.tensor([3, 5, 5, 6], dtype=torch.int32)
    greedy = torch.tensor([True, False, False, False])
    # req1: u*q = .2475 < .5 accept; .24 < .2 no -> 1.  req3: .29 < .3 accept -> 1
    assert rejection_accept(p, q, draft, argmax, u, cu, greedy).tolist() == [1, 1, 0, 1]


def test_recovered_never_picks_zero_residual_tokens():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.5, 0.1, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25]])  # row 1: p == q
    u = torch.linspace(0, 0.999, 50)
    for x in u:
        rec = sample_recovered(p, q, torch.tensor([2, 0]), x.expand(2))
        assert rec[0].item() == 1  # only token 1 has p > q
        assert 0 <= rec[1].item() < 4  # no residual: falls back to p


def test_recovered_one_hot_draft_excludes_the_draft():
    p = torch.tensor([[0.2, 0.3, 0.5]])
    seen = {sample_recovered(p, None, torch.tensor([2]), torch.tensor([u])).item() for u in torch.linspace(0, 0.999, 100)}
    assert seen == {0, 1}


def test_accept_plus_recover_is_exact_in_distribution():
    """One draft position, q != p: accept-or-recover yields p exactly.
    Seed 0, 200k vectorised draws, chi-square, 4 dof, alpha = 1e-3 (critical
    value 18.47): a correct implementation fails this with probability 0.001."""
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    p = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    draft = torch.multinomial(q, n, replacement=True, generator=gen)
    u = torch.rand(n, generator=gen)
    acc = rejection_accept(p[draft], q[draft], draft, torch.zeros(n, dtype=torch.long), u,
                           torch.arange(1, n + 1, dtype=torch.int32), torch.zeros(n, dtype=torch.bool))
    rejected = acc == 0
    rec = sample_recovered(p.expand(int(rejected.sum()), 5), q.expand(int(rejected.sum()), 5),
                           draft[rejected], torch.rand(int(rejected.sum()), generator=gen))
    out = draft.clone()
    out[rejected] = rec
    counts = torch.bincount(out, minlength=5).double()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 18.47, (chi2, counts / n)
