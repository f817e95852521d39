"""confidence_cutoff: the torch twin's semantics, and the Triton kernel against
the twin under TRITON_INTERPRET=1 (run by `make test` in its own pytest call)."""

import os

import pytest
import torch

from vllm_dspark.ops.reference import confidence_cutoff as twin


def test_twin_semantics():
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.1], [0.4, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.9, float("nan"), 1.0, 1.0]])
    cap = torch.tensor([4, 4, 2, 4], dtype=torch.int32)
    # cumulative products: .9 .81 .729 .0729 | .4 ... | 1 1 1 1 (capped at 2) | .9 0 0 0
    assert twin(conf, 0.7, cap).tolist() == [3, 0, 2, 1]
    assert twin(conf, 0.0, cap).tolist() == [4, 4, 2, 4]  # threshold 0 verifies everything allowed
    assert twin(conf, 1.0, cap).tolist() == [0, 0, 2, 0]


def test_twin_is_non_anticipating():
    """Changing confidences at positions >= j never changes whether the kept
    prefix reaches j (the decision for j reads c_1..c_j only)."""
    gen = torch.Generator().manual_seed(0)
    conf = torch.rand(256, 7, generator=gen)
    cap = torch.full((256,), 7, dtype=torch.int32)
    base = twin(conf, 0.3, cap)
    for j in range(7):
        changed = conf.clone()
        changed[:, j + 1 :] = torch.rand(256, 6 - j, generator=gen)
        again = twin(changed, 0.3, cap)
        assert torch.equal(base.clamp(max=j + 1), again.clamp(max=j + 1))


interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@interp
@pytest.mark.parametrize(("rows", "k"), [(1, 1), (1, 7), (5, 3), (64, 7), (130, 16)])
def test_kernel_matches_twin(rows, k):
    from vllm_dspark.ops.cutoff import confidence_cutoff as kernel

    gen = torch.Generator().manual_seed(rows * 100 + k)
    conf = torch.rand(rows, k, generator=gen)
    conf[::3] = 1.0  # all-ones rows
    conf[1::5, 0] = 0.0  # zero confidence at the first position
    conf[2::7] = 0.5  # ties: 0.5, 0.25, ... hit the thresholds exactly
    cap = torch.randint(0, k + 1, (rows,), generator=gen, dtype=torch.int32)
    for thr in (0.0, 0.25, 0.5, 0.9, 1.0):
        assert torch.equal(kernel(conf, thr, cap), twin(conf, thr, cap)), thr
