"""Shared pieces of the end-to-end tests: engine settings, the identity prompt
set, and a no-speculation reference computed once per session (one engine
alive at a time keeps memory and the 2 cores free)."""

import contextlib
import os

import pytest

from tests.conftest import DRAFTER_DIR, TARGET_DIR
from vllm_dspark.benchmarking import spec_counters, start_engine, stop_engine  # noqa: F401

IDENTITY_PROMPTS = 32
IDENTITY_TOKENS = 128


def dspark_config(k: int = 7) -> dict:
    return {"method": "dspark", "model": str(DRAFTER_DIR), "num_speculative_tokens": k}


def greedy_params(max_tokens: int = IDENTITY_TOKENS, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# The identity tests compare engines in float32. In bfloat16 the tiny target
# has near-ties one bf16 step apart (held-out prompt 3, token 22: logits 8.0625
# and 8.0, 0.013 apart in float32), and which one wins depends on the shape of
# the step that computes it (how many tokens a verify step carries), so a
# bf16 run can differ from no-spec there with or without any bug; in float32
# such gaps are far above rounding. Benchmarks run in bfloat16.
TEST_DTYPE = "float32"


# An engine in the test's own process: vLLM's engine core and worker run in
# pytest's process instead of two processes of their own, each of which
# imports vLLM (about 13 s apiece on an AMD EPYC without AVX-512: an engine
# took 35-60 s to start there, in-process 5 s). The scheduler, runner, plugin
# and sampler are the same code. The process layout users get is kept by the
# no-spec reference (the plugin registers in the worker's own process),
# test_dspark_engine.py (the defaults, through LLM()), test_serve.py and
# test_tensor_parallel.py.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                  "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # no pinning of pytest's own process


@contextlib.contextmanager
def _process_layout(in_process: bool):
    """vLLM reads these at engine construction; an in-process engine core
    then caches vLLM's environment (vllm.envs.enable_envs_cache), so the
    cache is dropped on both sides and the variables restored after."""
    import vllm.envs

    saved = {k: os.environ.get(k) for k in IN_PROCESS_ENV}
    if in_process:
        os.environ.update(IN_PROCESS_ENV)
    else:
        for k in IN_PROCESS_ENV:
            os.environ.pop(k, None)
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        vllm.envs.disable_envs_cache()


def make_llm(in_process: bool = True, **kw):
    # collective_rpc ships small lambdas to the worker in these tests.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    with _process_layout(in_process):
        return start_engine(str(TARGET_DIR), max_num_seqs=16, dtype=TEST_DTYPE, **kw)


@pytest.fixture(scope="session")
def identity_prompts(heldout_prompts) -> list[str]:
    return [p["text"] for p in heldout_prompts[:IDENTITY_PROMPTS]]


@pytest.fixture(scope="session")
def nospec_reference(identity_prompts):
    """Greedy no-speculation outputs (token ids and text) for the identity
    prompts, plus what the plugin-discovery and determinism tests need."""
    llm = make_llm(in_process=False)
    try:
        first = llm.generate(identity_prompts, greedy_params(), use_tqdm=False)
        second = llm.generate(identity_prompts[:8], greedy_params(48), use_tqdm=False)
        alone = [llm.generate([p], greedy_params(48), use_tqdm=False)[0] for p in identity_prompts[:2]]
        workers = llm.collective_rpc(lambda self: __import__("vllm_dspark.plugin").plugin.registration_info())
        seeded = llm.generate(identity_prompts[:2], seeded_params(), use_tqdm=False)
    finally:
        stop_engine(llm)
    return {
        "token_ids": [list(o.outputs[0].token_ids) for o in first],
        "text": [o.outputs[0].text for o in first],
        "second_48": [list(o.outputs[0].token_ids) for o in second],
        "alone_48": [list(o.outputs[0].token_ids) for o in alone],
        "workers": workers,
        "seeded": [list(o.outputs[0].token_ids) for o in seeded],
    }


def seeded_params(**kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=48, ignore_eos=True, **kw)


def assert_exact_with_shorter_blocks(llm, prompts, reference) -> None:
    """Greedy output equals no-spec output while fewer than full blocks are
    verified, and what is verified passes more often than full blocks do
    (vLLM's own counters, which count only verified drafts)."""
    outs = llm.generate(prompts, greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference["token_ids"]
    c = spec_counters(llm)
    per_draft = c["num_draft_tokens"] / c["num_drafts"]
    accept_rate = c["num_accepted_tokens"] / c["num_draft_tokens"]
    assert 0 < per_draft < 7 * 0.8, per_draft  # "full" verifies exactly 7 per draft
    # It keeps the tokens most likely to pass: a higher acceptance rate than
    # full blocks (about 0.21 = 1.5 / 7 there).
    assert accept_rate > 0.3, accept_rate


def _exact_second_token_marginal(prompt_ids: list[int], temperature: float, top_p: float | None):
    """P(x1 | prompt) = sum_x0 P(x0 | prompt) P(x1 | prompt, x0) under the
    processed (temperature, top-p) distributions, from transformers in fp32."""
    import torch
    from transformers import Qwen3ForCausalLM

    def process(logits):
        p = torch.softmax(logits / temperature, -1)
        if top_p is not None:
            sorted_p, order = p.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
            p = p.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
            p = p / p.sum(-1, keepdim=True)
        return p

    model = Qwen3ForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()
    with torch.no_grad():
        p0 = process(model(torch.tensor([prompt_ids])).logits[0, -1])
        support = torch.nonzero(p0 > 1e-7).squeeze(1)
        batch = torch.cat([torch.tensor(prompt_ids).expand(len(support), -1), support[:, None]], 1)
        p1 = process(model(batch).logits[:, -1])
    return (p0[support, None] * p1).sum(0)


def assert_second_token_follows_target(llm, prompt: str, temperature: float, top_p: float | None) -> int:
    """The second generated token (the first one a verify step can produce)
    over 2000 requests against its exact marginal: Pearson's statistic over
    tokens with expected count >= 5 (the rest pooled), its p-value simulated
    under that marginal (``chi_square_pvalue``), failing below
    ``SAMPLED_TEST_ALPHA``. Engine seed 0, but the draws are not the same from
    run to run: which steps verify drafts depends on the measured step costs.
    Three tokens each: with two, the second is the last and nothing would be
    verified for it (a step verifies at most one less than the tokens left).
    Returns how many draft tokens were verified meanwhile."""
    import torch
    from vllm import SamplingParams

    draws = 2000
    params = SamplingParams(temperature=temperature, top_p=top_p or 1.0, max_tokens=3, ignore_eos=True)
    before = spec_counters(llm)
    outs = llm.generate([prompt] * draws, params, use_tqdm=False)
    verified = spec_counters(llm)["num_draft_tokens"] - before.get("num_draft_tokens", 0)
    prompt_ids = list(outs[0].prompt_token_ids)
    second = torch.tensor([o.outputs[0].token_ids[1] for o in outs])
    expected = _exact_second_token_marginal(prompt_ids, temperature, top_p)
    counts = torch.bincount(second, minlength=expected.numel())
    pvalue, stat, cells = chi_square_pvalue(counts, expected)
    assert cells >= 6, "the test needs a spread-out marginal to have power"
    assert pvalue > SAMPLED_TEST_ALPHA, (pvalue, stat, cells)
    return verified


# The suite's five sampled-distribution tests (two in test_dspark_engine.py,
# two in test_dspark_cost_curve.py, one in test_layouts.py) together fail a
# lossless engine with probability at most 0.001 (Bonferroni; at 1e-3 each,
# one of 57 CI runs failed by chance: docs/testing.md).
SAMPLED_TEST_ALPHA = 1e-3 / 5


def chi_square_pvalue(counts, probs, sims: int = 20000, seed: int = 0) -> tuple[float, float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` (cells with expected
    count >= 5; the rest pooled into one) and its p-value simulated from
    ``sims`` multinomial samples of the same size under ``probs`` (seeded), as
    (1 + samples at least as far) / (1 + sims): exact at any cell count,
    where the chi-square tail is an approximation. Returns (p, statistic,
    cells)."""
    import torch

    draws = int(counts.sum())
    probs = probs.double() / probs.double().sum()
    big = draws * probs >= 5
    q, obs = probs[big], counts.double()[big]
    if not big.all():
        q, obs = torch.cat([q, probs[~big].sum()[None]]), torch.cat([obs, counts.double()[~big].sum()[None]])

    def statistic(o):
        return ((o - draws * q) ** 2 / (draws * q)).sum(-1)

    gen = torch.Generator().manual_seed(seed)
    left = torch.full((sims,), float(draws), dtype=torch.float64)
    mass, sample = 1.0, []
    for p in q[:-1].tolist():  # a multinomial as a chain of binomials, all samples at once
        cell = torch.binomial(left, torch.full_like(left, min(p / mass, 1.0)) if mass > 0 else left * 0,
                              generator=gen)
        sample.append(cell)
        left, mass = left - cell, mass - p
    sample.append(left)
    stat = float(statistic(obs))
    beyond = int((statistic(torch.stack(sample, -1)) >= stat - 1e-9).sum())
    return (1 + beyond) / (1 + sims), stat, len(q)
