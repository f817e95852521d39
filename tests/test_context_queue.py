"""The drafter's queued context writes (steps whose drafting was skipped)
leave its KV cache as writing step by step would have."""

import torch

from vllm_dspark.proposer import context_queue
from vllm_dspark.proposer.context_queue import ContextQueue
from vllm_dspark.proposer.drafter_slots import DrafterSlots
from vllm_dspark.proposer.dspark_proposer import DSparkProposer


class _FakeDrafter:
    """Stands in for the draft model: a 'KV cache' indexed by slot that stores
    (fused feature sum, position) per write, in order."""

    def __init__(self, slots: int):
        self.cache = torch.full((slots, 2), -1.0)
        self.calls = 0

    def combine_hidden_states(self, features):
        return features.sum(-1, keepdim=True)

    def precompute_and_store_context_kv(self, states, positions, slots):
        self.calls += 1
        assert slots.unique().numel() == slots.numel(), "one call must not write a slot twice"
        self.cache[slots] = torch.cat([states, positions[:, None].float()], dim=1)


def _proposer(slots=32):
    p = object.__new__(DSparkProposer)  # no vLLM config needed for the queue
    p.context_queue = ContextQueue(p._write_context)
    p.slots = DrafterSlots()
    p.model = _FakeDrafter(slots)
    return p


def _steps():
    gen = torch.Generator().manual_seed(0)
    # (aux states per layer, positions, slots); step 2 reuses slots 1 and 2 (a
    # request finished, its blocks went to a new one), step 3 reuses slot 2 again.
    layout = [([0, 1, 2], [5, 9, 3]), ([1, 2, 4], [0, 1, 7]), ([2, 6], [2, 8])]
    for slots, positions in layout:
        aux = [torch.rand(len(slots), 3, generator=gen) for _ in range(2)]
        yield aux, torch.tensor(positions), torch.tensor(slots)


def test_queued_writes_equal_step_by_step_writes():
    stepwise, queued = _proposer(), _proposer()
    for aux, pos, slots in _steps():
        stepwise.defer_context(aux, pos, slots)
        stepwise.flush_context()
        queued.defer_context(aux, pos, slots)
    assert queued.model.calls == 0  # nothing written until a flush
    queued.flush_context()
    assert queued.model.calls == 1
    assert torch.equal(queued.model.cache, stepwise.model.cache)
    queued.flush_context()
    assert queued.model.calls == 1  # an empty queue writes nothing


def test_queue_flushes_itself_when_full(monkeypatch):
    monkeypatch.setattr(context_queue, "CONTEXT_QUEUE_STEPS", 2)
    p = _proposer()
    steps = list(_steps())
    p.defer_context(*steps[0])
    assert p.model.calls == 0
    p.defer_context(*steps[1])
    assert p.model.calls == 1 and len(p.context_queue) == 0


def test_finished_requests_context_is_not_written():
    """Two requests a (2 tokens a step) and b (1 token); b finishes before
    the flush: a's writes land as step by step, b's slots stay untouched."""
    stepwise, queued = _proposer(), _proposer()
    queued.context_queue.live_requests = {"a": object()}
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        slots = torch.tensor([2 * step, 2 * step + 1, 20 + step])  # a, a, b
        pos = torch.tensor([2 * step, 2 * step + 1, step])
        aux = [torch.rand(3, 3, generator=gen) for _ in range(2)]
        stepwise.defer_context([h[:2] for h in aux], pos[:2], slots[:2])
        stepwise.flush_context()
        queued.defer_context(aux, pos, slots, ["a", "b"], [2, 1])
    queued.flush_context()
    assert torch.equal(queued.model.cache, stepwise.model.cache)
    assert (queued.model.cache[20:23] == -1).all()
    # No live request left: nothing is written at all.
    queued.defer_context(aux, pos, slots, ["a", "b"], [2, 1])
    queued.context_queue.live_requests = {}
    calls = queued.model.calls
    queued.flush_context()
    assert queued.model.calls == calls and len(queued.context_queue) == 0


def test_buffer_is_reused_and_big_steps_are_written_at_once(monkeypatch):
    """Queued steps are copies in one reused buffer (holding each step's own
    tensors slowed the target's forward); a step too big for the buffer is
    written at once, after what was queued before it."""
    stepwise, queued = _proposer(), _proposer()
    steps = list(_steps())
    for aux, pos, slots in steps[:2]:
        stepwise.defer_context(aux, pos, slots)
        stepwise.flush_context()
        queued.defer_context(aux, pos, slots)
    buffer = queued.context_queue._features
    for h in steps[0][0]:
        h.fill_(123.0)  # the caller may reuse its tensors: the queue holds copies
    queued.flush_context()
    assert torch.equal(queued.model.cache, stepwise.model.cache)
    queued.defer_context(*steps[2])
    assert queued.context_queue._features is buffer
    per_token = sum(h.shape[-1] for h in steps[2][0]) * steps[2][0][0].element_size()
    monkeypatch.setattr(context_queue, "CONTEXT_QUEUE_BYTES", per_token)  # one token fits
    calls = queued.model.calls
    queued.defer_context(*steps[2])  # 2 tokens: the queued step, then this one
    assert queued.model.calls == calls + 2 and len(queued.context_queue) == 0
