"""The simulated chi-square p-value the sampled-distribution tests use
(tests/e2e/conftest.py): calibrated under its null, powerful off it, and the
chi-square tail's value where that approximation holds. Everything is seeded
(seed 0), so each assertion is decided once; the bounds are set so a correct
helper would fail them with the probabilities stated."""

import math

import torch

from tests.e2e.conftest import chi_square_pvalue


def _spread(cells: int = 70) -> torch.Tensor:
    """A marginal shaped like the tests' (a few hundred expected draws in the
    top cells, a long tail of 5-10 and below) at 2,000 draws."""
    p = 1.0 / torch.arange(1, cells + 1, dtype=torch.float64) ** 1.1
    return p / p.sum()


def _draw(probs, n, gen):
    return torch.bincount(torch.multinomial(probs, n, replacement=True, generator=gen), minlength=len(probs))


def test_pvalues_are_uniform_under_the_null():
    """200 samples of 2,000 from the marginal itself: the count of p < 0.1 is
    Binomial(200, 0.1) (mean 20, sd 4.2) for a calibrated p-value; the bounds
    6 and 38 fail a calibrated one with probability < 1e-4."""
    probs, gen = _spread(), torch.Generator().manual_seed(0)
    pvalues = [chi_square_pvalue(_draw(probs, 2000, gen), probs, sims=2000, seed=i)[0] for i in range(200)]
    below = sum(p < 0.1 for p in pvalues)
    assert 6 <= below <= 38, below


def test_a_small_shift_is_caught():
    """8% of all the mass moved from the top cell to the second, about the
    least the tests' 2,000 draws resolve at their threshold (a wrong
    acceptance rule leaks the drafter's bias far more): p < 2e-4 in all of
    ten samples of 2,000."""
    probs, gen = _spread(), torch.Generator().manual_seed(0)
    biased = probs.clone()
    biased[0] -= 0.08
    biased[1] += 0.08
    for i in range(10):
        assert chi_square_pvalue(_draw(biased, 2000, gen), probs, seed=i)[0] < 2e-4


def test_matches_the_chi_square_tail_where_that_holds():
    """Ten cells of expected count >= 5,000: the simulated p-value is the
    chi-square tail's to within 0.02 (its Monte Carlo sd at 20,000 samples
    is at most 0.0036)."""
    probs, gen = _spread(10), torch.Generator().manual_seed(0)
    for _ in range(5):
        counts = _draw(probs, 100_000, gen)
        p, stat, cells = chi_square_pvalue(counts, probs)
        tail = float(torch.special.gammaincc(torch.tensor((cells - 1) / 2.0), torch.tensor(stat / 2)))
        assert cells == 10 and math.isclose(p, tail, abs_tol=0.02), (p, tail)
