"""The replay loop: R request slots step through recorded blocks together.

Each slot plays one traced request's blocks in order and takes another
request (drawn at random) when it runs out, so the batch stays at R. Every
step every slot consumes one block, whatever the policy did, so all policies
and the oracle see exactly the same blocks and outcomes. A block verified to
length L yields min(L, a) + 1 tokens, where a is how many of its K drafts the
target accepted in the full-block trace (acceptance is a prefix property, so
a shorter verification accepts the same first tokens). A step costs
T_spec(R, R + sum L) + T_draft(R) when the policy drafted, else T_plain(R, R)
(T_nospec(R, R) for the engine without speculation, which on a CPU is
cheaper than a speculating engine's skipped step, and for a step the
controller runs plain while dormant). Prefill is left out: these
are decode-only, closed-loop batches.
"""

from dataclasses import dataclass

import numpy as np

WARMUP_STEPS = 300  # controller policies learn costs and calibration first; not counted


@dataclass
class Blocks:
    """The blocks of one replay: [steps, R] (ids, greedy, accepted) and [steps, R, K] logits."""

    ids: np.ndarray  # object: request-instance ids
    raw: np.ndarray
    prev_raw: np.ndarray  # the same request's previous block (stale policies)
    greedy: np.ndarray
    accepted: np.ndarray


def draw_blocks(trace, num_reqs: int, steps: int, seed: int) -> Blocks:
    from vllm_dspark.sim.policies import NO_HISTORY_LOGIT

    rng = np.random.default_rng([seed, num_reqs])
    seqs = [np.array([b[0] for b in blocks]) for blocks in trace.requests.values()]
    greedy = [np.array([b[2] for b in blocks]) for blocks in trace.requests.values()]
    # Positions past a cut verification count as rejected (only full traces see them all).
    acc = [np.array([min(b[4], b[3]) if b[3] == trace.block_len else min(b[4], b[3] - 1) for b in blocks])
           for blocks in trace.requests.values()]
    k = trace.block_len
    out = Blocks(np.empty((steps, num_reqs), object), np.empty((steps, num_reqs, k)),
                 np.full((steps, num_reqs, k), NO_HISTORY_LOGIT), np.empty((steps, num_reqs), bool),
                 np.empty((steps, num_reqs), np.int64))
    instance = 0
    for slot in range(num_reqs):
        seq = rng.integers(len(seqs))
        pos = rng.integers(len(seqs[seq]))  # slots start mid-request: a steady state, not a wave
        for s in range(steps):
            if pos >= len(seqs[seq]):
                seq, pos, instance = rng.integers(len(seqs)), 0, instance + 1
            out.ids[s, slot] = f"{slot}-{instance}-{seq}"
            out.raw[s, slot] = seqs[seq][pos]
            if pos > 0:
                out.prev_raw[s, slot] = seqs[seq][pos - 1]
            out.greedy[s, slot] = greedy[seq][pos]
            out.accepted[s, slot] = acc[seq][pos]
            pos += 1
        instance += 1
    return out


@dataclass
class Result:
    tokens: float
    seconds: float
    verified: float = 0.0
    drafted_steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _plain_cost(policy, curve):
    """Step cost without drafts: an engine without speculation (nospec) is
    priced as such, every other policy runs a DSpark engine that skips."""
    return curve.nospec if getattr(policy, "no_drafter", False) else curve.plain


def _play_step(policy, curve, plain, ids, raw, prev_raw, greedy, accepted, left=None):
    """One step of ``len(ids)`` requests (``left``: the tokens each has left
    before its end, None in a refilled batch): the policy decides (skip, then
    lengths) before it sees the outcomes, which it is shown last. Returns
    (lengths or None, accepted drafts per request, target seconds, drafting
    seconds). A step the policy ran plain costs a no-spec engine's step."""
    r = len(ids)
    if policy.skip(ids):
        price = curve.nospec if policy.ran_plain else plain
        lengths, got, target_s, draft_s = None, np.zeros(r, np.int64), float(price(r, r)), 0.0
        tokens = r
    else:
        lengths = policy.lengths(ids, raw, prev_raw, greedy)
        got = np.minimum(lengths, accepted)
        tokens = r + int(lengths.sum())
        target_s, draft_s = float(curve.spec(r, tokens)), float(curve.draft(r))
    policy.observe(ids, lengths, None if lengths is None else got, r, tokens, target_s, draft_s,
                   0 if lengths is None else r, left)
    return lengths, got, target_s, draft_s


def replay(policy, blocks: Blocks, curve, warmup: int = WARMUP_STEPS) -> Result:
    steps, r, k = blocks.raw.shape
    res = Result(0.0, 0.0)
    plain = _plain_cost(policy, curve)
    for s in range(steps):
        lengths, got, target_s, draft_s = _play_step(
            policy, curve, plain, list(blocks.ids[s]), blocks.raw[s], blocks.prev_raw[s],
            blocks.greedy[s].tolist(), blocks.accepted[s])
        if s >= warmup:
            res.tokens += r + int(got.sum())
            res.seconds += target_s + draft_s
            if lengths is not None:
                res.verified += float(lengths.sum())
                res.drafted_steps += 1
    return res


def replay_waves(policy, trace, wave: int, max_tokens: int, prompt_tokens: int, curve,
                 skip_requests: int = 0) -> Result:
    """The benchmark's own shape, for validation: the traced requests in their
    recorded order, in waves of ``wave`` that start together with one
    prefill step and run until each has ``max_tokens`` tokens, the batch
    shrinking as requests finish. Each request replays its own blocks."""
    seqs = [[(np.array(b[0]), b[2], min(b[4], b[3])) for b in blocks]
            for blocks in list(trace.requests.values())[skip_requests:]]
    res = Result(0.0, 0.0)
    plain = _plain_cost(policy, curve)
    for w in range(0, len(seqs), wave):
        group = seqs[w : w + wave]
        res.seconds += float(plain(len(group), len(group) * prompt_tokens))
        made, pos = [1] * len(group), [0] * len(group)  # the prefill step samples each first token
        while True:
            live = [i for i in range(len(group)) if made[i] < max_tokens]
            if not live:
                break
            blocks = [group[i][pos[i]] if pos[i] < len(group[i]) else (np.zeros(trace.block_len), True, 0)
                      for i in live]
            raw = np.stack([b[0] for b in blocks])
            _, got, target_s, draft_s = _play_step(
                policy, curve, plain, [f"{w}-{i}" for i in live], raw, raw, [b[1] for b in blocks],
                np.array([b[2] for b in blocks]), [max_tokens - made[i] for i in live])
            res.seconds += target_s + draft_s
            for j, i in enumerate(live):
                step = min(1 + int(got[j]), max_tokens - made[i])
                made[i] += step
                res.tokens += step
                pos[i] += 1
    return res


def oracle(blocks: Blocks, curve, warmup: int = WARMUP_STEPS, iters: int = 30) -> Result:
    """The best any policy could do on these blocks and this curve, knowing
    every outcome: per step, skip drafting (R tokens, the cheaper of T_plain
    and T_nospec: a dormant engine's plain step) or draft and
    verify m of the sum-of-a accepted drafts (R + m tokens, T_spec(R, R + m) +
    T_draft). Whole-run throughput sum(n) / sum(t) is maximised exactly by
    Dinkelbach's iteration: pick each step's option maximising n - theta t,
    set theta to the resulting ratio, repeat until it stops rising. Running
    an engine without speculation instead is the other option, taken if it
    is faster (on a CPU its steps are cheaper than skipped ones)."""
    acc = blocks.accepted[warmup:]
    steps, r = acc.shape
    total = acc.sum(1)  # accepted drafts available per step
    m = np.arange(int(total.max()) + 1)
    spec_t = curve.spec(r, r + m) + curve.draft(r)  # [M]
    # A step without drafts at its cheapest: a dormant engine runs it as a no-spec step.
    plain_t = min(float(curve.plain(r, r)), float(curve.nospec(r, r)))
    valid = m[None, :] <= total[:, None]  # [steps, M]
    theta, best = 0.0, None
    for _ in range(iters):
        score = np.where(valid, (r + m)[None, :] - theta * spec_t[None, :], -np.inf)
        pick = score.argmax(1)
        draft_better = score[np.arange(steps), pick] > r - theta * plain_t
        n = np.where(draft_better, r + m[pick], r).sum()
        t = np.where(draft_better, spec_t[pick], plain_t).sum()
        new = n / t
        if best is not None and new <= theta * (1 + 1e-12):
            break
        theta, best = new, Result(float(n), float(t), float(np.where(draft_better, m[pick], 0).sum()),
                                  int(draft_better.sum()))
    nospec_t = float(curve.nospec(r, r)) * steps
    return best if best.tokens_per_s >= r * steps / nospec_t else Result(float(r * steps), nospec_t)
