"""Triton verification kernels against their torch twins (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

from vllm_dspark.ops import reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("seed", range(4))
def test_rejection_accept_matches_twin(seed):
    from vllm_dspark.ops.rejection import rejection_accept

    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 8, (13,), generator=gen)
    counts[0] = 0  # a request with no drafts
    counts[1] = 7
    total = int(counts.sum())
    cu = counts.cumsum(0).to(torch.int32)
    draft = torch.randint(0, 5, (total,), generator=gen)
    argmax = torch.where(torch.rand(total, generator=gen) < 0.7, draft, (draft + 1) % 5)
    p = torch.rand(total, generator=gen)
    q = torch.rand(total, generator=gen)
    q[::4] = 1.0  # one-hot drafts
    u = torch.rand(total, generator=gen)
    u[::5] = p[::5] / q[::5]  # ties: u * q == p is a rejection in both
    greedy = torch.rand(13, generator=gen) < 0.4
    args = (p, q, draft, argmax, u, cu, greedy)
    assert torch.equal(rejection_accept(*args), reference.rejection_accept(*args))


@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (9, 130), (4, 2048), (3, 3000)])
def test_sample_recovered_matches_twin(rows, vocab):
    from vllm_dspark.ops.rejection import sample_recovered

    gen = torch.Generator().manual_seed(rows * vocab)
    p = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, -1)
    q[0] = p[0]  # no residual mass: falls back to p
    draft = torch.randint(0, vocab, (rows,), generator=gen)
    for _ in range(5):
        u = torch.rand(rows, generator=gen)
        for q_arg in (q, None):
            got = sample_recovered(p, q_arg, draft, u)
            want = reference.sample_recovered(p, q_arg, draft, u)
            for r in torch.nonzero(got != want).flatten().tolist():
                assert _on_cdf_step(p[r], None if q_arg is None else q_arg[r], draft[r], u[r]), r


# The kernel sums the CDF block by block, the twin sequentially; they may only
# disagree when u * total lies within float rounding of a CDF step.
CDF_STEP_TOL = 1e-6


def _on_cdf_step(p, q, draft, u) -> bool:
    if q is None:
        q = torch.zeros_like(p)
        q[draft] = 1.0
    w = (p - q).clamp(min=0)
    w = w if w.sum() > reference.RESIDUAL_EPS else p
    cdf = w.double().cumsum(0)
    return bool(((cdf - u.double() * cdf[-1]).abs() < CDF_STEP_TOL).any())
