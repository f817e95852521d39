"""adaptive_lengths: semantics and properties of the torch twin, and the Triton
kernel against it under TRITON_INTERPRET=1."""

import math
import os

import pytest
import torch

from vllm_dspark.ops.reference import adaptive_lengths as twin

INF = math.inf
BIG = 1 << 30


def _full(rows, k):
    return torch.full((rows,), k, dtype=torch.int32)


def test_hand_example():
    # survivals: r0: .9 .81 .405 ; r1: .5 .25 .125. R=2, base=1, token=0.1.
    conf = torch.tensor([[0.9, 0.9, 0.5], [0.5, 0.5, 0.5]])
    # order: .9 .81 .5 .405 .25 .125; theta: 2/1, 2.9/1.1=2.636, 3.71/1.2=3.092, 4.21/1.3=3.238,
    # 4.615/1.4=3.296, then 4.865/1.5=3.243 drops -> admit 4: r0 all 3, r1 one.
    assert twin(conf, _full(2, 3), 1.0, 0.1, INF, BIG).tolist() == [3, 1]
    # pricier tokens: the first draft already lowers goodput (2.9/1.5 < 2/1)
    assert twin(conf, _full(2, 3), 1.0, 0.5, INF, BIG).tolist() == [0, 0]
    # token cap and step-time cap
    assert twin(conf, _full(2, 3), 1.0, 0.1, INF, 2).tolist() == [2, 0]
    assert twin(conf, _full(2, 3), 1.0, 0.1, 1.3, BIG).tolist() == [2, 1]
    # per-request caps: r0 may verify one; then .5 (r1) and .25 (r1) -> 3.65/1.3 < 3.4/1.2 stops
    assert twin(conf, torch.tensor([1, 3], dtype=torch.int32), 1.0, 0.1, INF, BIG).tolist() == [1, 1]


def test_edges():
    assert twin(torch.zeros(3, 4), _full(3, 4), 1.0, 0.01, INF, BIG).tolist() == [0, 0, 0]
    assert twin(torch.ones(1, 1), _full(1, 1), 1.0, 0.01, INF, BIG).tolist() == [1]
    assert twin(torch.ones(4, 7), _full(4, 7), 1.0, 1e-6, INF, BIG).tolist() == [7] * 4
    assert twin(torch.ones(2, 5), _full(2, 5), 1.0, 0.01, 0.5, BIG).tolist() == [0, 0]  # SLO unmeetable
    ties = torch.full((3, 4), 0.5)
    out = twin(ties, _full(3, 4), 1.0, 0.3, INF, BIG)
    assert out.tolist() == sorted(out.tolist(), reverse=True)  # ties go to lower rows first


def test_non_anticipating():
    """Whether position j of request r is verified never depends on the
    confidences of later positions of that request."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows, k = 6, 7
        conf = torch.rand(rows, k, generator=gen) ** 0.5
        base = twin(conf, _full(rows, k), 1.0, 0.05, INF, BIG)
        r, j = int(torch.randint(rows, (1,), generator=gen)), int(torch.randint(k - 1, (1,), generator=gen))
        changed = conf.clone()
        changed[r, j + 1:] = torch.rand(k - j - 1, generator=gen)
        again = twin(changed, _full(rows, k), 1.0, 0.05, INF, BIG)
        assert (base[r] > j) == (again[r] > j)


def test_monotone_in_load():
    """Pricier verification never buys more tokens, and more requests sharing
    a step never get longer drafts each."""
    gen = torch.Generator().manual_seed(1)
    conf = torch.rand(8, 7, generator=gen) ** 0.3
    budgets = [int(twin(conf, _full(8, 7), 5e-3, t, INF, BIG).sum()) for t in (1e-5, 1e-4, 3e-4, 1e-3, 3e-3)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    row = conf[:1]
    means = [float(twin(row.expand(r, 7), _full(r, 7), 5e-3, 2e-4, INF, BIG).float().mean()) for r in (1, 4, 16, 64, 256)]
    assert all(a >= b for a, b in zip(means, means[1:])) and means[0] > means[-1]


interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@interp
@pytest.mark.parametrize(("rows", "k"), [(1, 1), (1, 7), (5, 3), (64, 7), (256, 16)])
def test_kernel_matches_twin(rows, k):
    from vllm_dspark.ops.adaptive import adaptive_lengths as kernel

    gen = torch.Generator().manual_seed(rows * 31 + k)
    conf = torch.rand(rows, k, generator=gen) ** 0.3
    conf[::4] = 0.5  # ties
    conf[1::5, 0] = 0.0  # zero confidence at the first position
    cap = torch.randint(0, k + 1, (rows,), generator=gen, dtype=torch.int32)
    settings = [(5e-3, 1e-4, INF, BIG), (5e-3, 1e-3, INF, BIG), (5e-3, 2e-5, 8e-3, 50)]
    for base, tok, tmax, mt in settings[:1] if rows * k > 1024 else settings:  # the interpreter is slow
        assert torch.equal(kernel(conf, cap, base, tok, tmax, mt), twin(conf, cap, base, tok, tmax, mt))


@pytest.mark.parametrize("path", ["scalar", "host"])
@pytest.mark.parametrize(("rows", "k"), [(1, 1), (1, 7), (5, 3), (27, 7), (64, 7), (256, 16)])
def test_cpu_paths_match_twin(path, rows, k):
    """ops.scalar and ops.host (what CPU runs for small and larger problems)
    give the twin's lengths exactly: random confidences with ties, zeros, NaN
    and infinities, random caps, and the caps on step time and tokens."""
    import importlib

    scalar = importlib.import_module(f"vllm_dspark.ops.{path}").adaptive_lengths

    gen = torch.Generator().manual_seed(rows * 17 + k)
    for trial in range(20):
        conf = torch.rand(rows, k, generator=gen) ** (0.1 + trial / 10)
        conf[::4] = 0.5  # ties
        conf[1::5, 0] = 0.0  # zero confidence at the first position
        conf[2::7, -1] = float("nan")
        conf[3::11, 0] = float("inf")
        conf[4::13, -1] = -float("inf")
        cap = torch.randint(0, k + 1, (rows,), generator=gen, dtype=torch.int32)
        for base, tok, tmax, mt in [(5e-3, 1e-4, INF, BIG), (5e-3, 1e-3, INF, BIG), (5e-3, 2e-5, 8e-3, 50),
                                    (5e-3, 0.0, INF, 3), (0.0, 1e-4, INF, BIG), (0.0, 0.0, INF, BIG)]:
            expected = twin(conf, cap, base, tok, tmax, mt)
            got = scalar(conf, cap, base, tok, tmax, mt)
            assert got.dtype == expected.dtype and torch.equal(got, expected), (trial, base, tok, tmax, mt)


def test_host_path_takes_the_twin_s_survivals_bit_for_bit():
    """The survivals ops.host ranks candidates by are the twin's exactly
    (torch's CPU cumprod keeps its running product in float64 and rounds each
    output to float32; NumPy's float32 product drifted in the last bit): equal
    lengths alone would miss a difference until two candidates tie on it."""
    import numpy as np

    from vllm_dspark.ops.host import survivals

    gen = torch.Generator().manual_seed(1)
    conf = torch.rand(4000, 7, generator=gen) ** 0.3
    conf[::9, 1] = float("nan")
    conf[::11, 0] = float("inf")
    conf[::13, 2] = -1.0
    twin = torch.cumprod(torch.nan_to_num(conf, nan=0.0).clamp(0.0, 1.0), dim=1)
    assert np.array_equal(survivals(conf), twin.numpy())
