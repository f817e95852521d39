"""The drafter's queued context writes (steps whose drafting was skipped)
leave its KV cache as writing step by step would have."""

import torch

from vllm_dspark.proposer import dspark_proposer
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
    p._context_queue, p._context_queued_tokens = [], 0
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
    monkeypatch.setattr(dspark_proposer, "CONTEXT_QUEUE_STEPS", 2)
    p = _proposer()
    steps = list(_steps())
    p.defer_context(*steps[0])
    assert p.model.calls == 0
    p.defer_context(*steps[1])
    assert p.model.calls == 1 and p._context_queue == []
