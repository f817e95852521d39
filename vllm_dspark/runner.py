"""The DSpark model runners: vLLM's V1 runners with DSpark drafting and
load-aware, variable-length verification.

Changes, all in subclasses: the drafter is a DSparkProposer, the target emits
the auxiliary hidden states it reads, the rejection sampler is
DSparkRejectionSampler, and each step the controller cuts every request's new
block to its verify length before the scheduler sees it, so the verify batch
really shrinks and vLLM's acceptance metrics count only what was verified.
"""

import copy
import time
from typing import NamedTuple

import torch
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_dspark.compat.ledger import check_instance
from vllm_dspark.compat.patches import rebound
from vllm_dspark.config import parse_knobs
from vllm_dspark.controller.controller import DSparkController
from vllm_dspark.controller.plan import NO_DRAFT, DraftBlocks, StepTiming, StepView, VerifyOutcome, request_caps
from vllm_dspark.fingerprint import cost_cache_dir, cost_fingerprint
from vllm_dspark.metrics import SnapshotWriter, snapshot_dir
from vllm_dspark.plain_steps import PlainStepSwitch
from vllm_dspark.proposer.dspark_proposer import DSparkProposer
from vllm_dspark.rank_sync import rank0_share, step_clock
from vllm_dspark.rejection_sampler import DSparkRejectionSampler
from vllm_dspark.sampling import GREEDY_EPS
from vllm_dspark.scheduler import DRAFTS_ATTR, SLOTS_ATTR


class DSparkRunnerMixin:
    def __init__(self, vllm_config, device):
        # For method="dspark" the V1 runner builds an EagleProposer (use_eagle()
        # is true for dspark); have it build ours instead, for this call only.
        with rebound(gpu_model_runner, "EagleProposer", DSparkProposer):
            super().__init__(vllm_config, device)
        assert isinstance(self.drafter, DSparkProposer)
        check_instance(self, "runner-state")
        self.use_aux_hidden_state_outputs = True
        self.rejection_sampler = DSparkRejectionSampler(self.sampler, self.speculative_config, self.device)
        self._plain_switch = PlainStepSwitch(self, vllm_config)
        parallel = vllm_config.parallel_config
        self.dspark = DSparkController(parse_knobs(vllm_config.additional_config), self.drafter.block_len,
                                       fingerprint=cost_fingerprint(vllm_config), cache_dir=cost_cache_dir(),
                                       plain_steps=self._plain_switch.allowed, now=step_clock(parallel.rank),
                                       share=rank0_share(parallel.tensor_parallel_size), canary=self.device.type == "cpu")
        # Queued context is written only for live requests that keep it.
        self.drafter.context_queue.live_requests = self.dspark.ledger.wanted(self.requests)
        self._step_verifies = self._coasting = False
        self._may_draft = True  # what the scheduler was last told (it starts reserving draft slots, as vLLM does)
        # A coasting run (coasting.py): steps it may still coast unasked, its batch, those it did.
        self._coast_left, self._coast_batch, self._coasted_fast = 0, (0, 0), 0
        self._slots_of = self._slots = None  # the target's slot-mapping buffer, and its view
        self._track_slots = self.cache_config.enable_prefix_caching  # which slots hold drafter context
        self._dspark_timing = NO_DRAFT
        self._warm_up: dict | None = None  # the start-up warm-up's token counts and seconds (CPU)
        rank = parallel.rank
        self._dspark_snapshots = SnapshotWriter(snapshot_dir(vllm_config.instance_id) if rank == 0 else None,
                                                rank, self.dspark_snapshot)

    def _get_eagle3_aux_layers_from_config(self):
        # The V1 helper reads only DFlash/EAGLE keys; vLLM's V2 helper also reads
        # DSpark's top-level target_layer_ids (output of layer i = aux layer i+1).
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        return get_eagle3_aux_layers_from_config(self.speculative_config)

    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
        # With speculation configured, vLLM's V1 runner builds verify metadata
        # and samples through the rejection sampler on every step, even when no
        # request has drafts. Such a step is a plain decode step: its logits
        # rows are each request's last token, and _prepare_inputs below then
        # drops the metadata, so it samples and is bookkept exactly like one.
        if num_draft_tokens.any():
            return super()._calc_spec_decode_metadata(num_draft_tokens, cu_num_scheduled_tokens)
        return _LogitsRowsOnly(async_tensor_h2d(cu_num_scheduled_tokens - 1, device=self.device))

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        logits_indices, spec_decode_metadata, max_sampled = super()._prepare_inputs(
            scheduler_output, *args, **kwargs)
        if isinstance(spec_decode_metadata, _LogitsRowsOnly):
            spec_decode_metadata = None
        return logits_indices, spec_decode_metadata, max_sampled

    def dspark_snapshot(self) -> dict:
        return {**self.dspark.snapshot(self._coasted_fast).to_json(), "warm_up": self._warm_up}

    @torch.inference_mode()
    def warm_up_verify_shapes(self) -> tuple[int, float]:
        """Run the target (with its logits), the drafter's dummy pass and its
        context write once at every token count a verify step of up to ``warm_up_requests``
        requests can take, before any request: on CPU a count's first run
        builds its kernels (6-12 ms each on Zen 4), and a fresh engine's
        first trial at one request paid 38-80 ms of them, up to two thirds
        of its reserve, booked as drafting's loss (docs/controller.md). The
        same counts on every rank (the dummy passes hold collectives).
        Returns (the largest count run, seconds taken)."""
        sched = self.scheduler_config
        top = min((self.drafter.block_len + 1) * min(self.dspark.tuning.warm_up_requests, sched.max_num_seqs),
                  sched.max_num_batched_tokens)
        t0 = time.perf_counter()
        for tokens in range(1, top + 1):
            hidden, _ = self._dummy_run(tokens)
            self.model.compute_logits(hidden[:tokens])
            self.drafter.warm_up_context(tokens)
        self._warm_up = {"tokens": top, "seconds": round(time.perf_counter() - t0, 3)}
        return top, self._warm_up["seconds"]

    def execute_model(self, scheduler_output, *args, **kwargs):
        so, tokens = scheduler_output, scheduler_output.total_num_scheduled_tokens
        fast = self._coast_left and (len(so.num_scheduled_tokens), tokens) == self._coast_batch and not (
            so.scheduled_new_reqs or so.finished_req_ids or so.scheduled_cached_reqs.resumed_req_ids
            or so.scheduled_spec_decode_tokens)
        if fast:
            # The coasting run's batch, unchanged: this step coasts too, unasked (the fewer calls, the cheaper).
            self._coast_left -= 1
            self._coasted_fast += 1
        else:
            # A coasting step is already plain (the step before was), with no verification.
            run = self.dspark.coasts(so.num_scheduled_tokens, bool(so.scheduled_new_reqs),
                                     bool(so.scheduled_spec_decode_tokens), so.finished_req_ids, tokens,
                                     self._coasted_fast)
            self._coasting, self._coast_left, self._coasted_fast = run > 0, max(run - 1, 0), 0
            self._coast_batch = (len(so.num_scheduled_tokens), tokens)
        if not self._coasting:
            view = StepView.of(so, self._stale_prefixes(so))
            self._step_verifies = view.verifies  # the rejection sampler runs this step
            self._plain_switch.set(self.dspark.begin_step(view) is not None)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        if self._track_slots and tokens:
            # The buffer persists: a coasting step, the cheapest there is, takes the view as it was.
            self.drafter.slots.target_wrote((self._slots if fast else self._slot_mapping())[:tokens])
        return out

    def _slot_mapping(self):
        """The step's slots as the target wrote them: on CPU a NumPy view of
        vLLM's buffer (made once; the buffer is persistent), else the tensor."""
        buffer = self.input_batch.block_table[0].slot_mapping.gpu
        if buffer is not self._slots_of:
            self._slots_of, self._slots = buffer, buffer.numpy() if buffer.device.type == "cpu" else buffer
        return self._slots

    def _stale_prefixes(self, scheduler_output) -> frozenset[str]:
        """New requests whose prefix-cache hit has slots without drafter
        context (drafter_slots.py)."""
        new = scheduler_output.scheduled_new_reqs
        if not (new and self._track_slots):
            return frozenset()
        size, slots = self.cache_config.block_size, self.drafter.slots
        return frozenset(r.req_id for r in new if r.num_computed_tokens
                         and not slots.hold_context(r.block_ids[0], size, r.num_computed_tokens))

    def sample_tokens(self, *args, **kwargs):
        if self._coasting:
            return super().sample_tokens(*args, **kwargs)
        self._dspark_timing = NO_DRAFT
        out = super().sample_tokens(*args, **kwargs)
        if not self._plain_switch.on and isinstance(out, ModelRunnerOutput):
            # The drafts travel with the output (DSparkScheduler applies them),
            # saving the engine core's take_draft_token_ids round trip. On a
            # copy: vLLM reuses some output objects. All empty (drafter
            # skipped): nothing to apply, and no attribute (the scheduler reads
            # a missing one as None); vLLM already cleared every scheduled
            # request's drafts when it scheduled them.
            drafts = self.take_draft_token_ids()
            if drafts is not None and any(drafts.draft_token_ids):
                out = copy.copy(out)
                setattr(out, DRAFTS_ATTR, drafts)
        self.dspark.end_step(self._dspark_timing)
        may_draft = not self.dspark.dormancy.dormant
        if may_draft != self._may_draft and isinstance(out, ModelRunnerOutput):
            # The scheduler reserves KV slots for drafts only while the coming steps may draft (scheduler.py).
            out, self._may_draft = copy.copy(out), may_draft
            setattr(out, SLOTS_ATTR, may_draft)
        return out

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        """Enact the controller's plan. Blocks count as drafted even when the
        controller then verifies none of them: the drafting model must learn
        from those steps too. The whole path (vLLM's input preparation and the
        controller's choices included) is timed: it is what skipping saves."""
        t0 = time.perf_counter()
        req_ids = list(self.input_batch.req_ids)
        outcome = self.rejection_sampler.take_outcome() if self._step_verifies else None
        requests = _Requests(self, req_ids, outcome)
        if outcome is not None:
            self.dspark.observe(VerifyOutcome(req_ids, *outcome, requests.left()))
        plan = self.dspark.plan(requests)
        if plan.mode == "skip":
            self._defer_context(plan.contextless, scheduler_output, req_ids, aux_hidden_states,
                                common_attn_metadata)
            self._dspark_timing = StepTiming(time.perf_counter() - t0)
            return [[] for _ in req_ids]
        # The context queued by skipped steps is written first and timed apart:
        # it is the skipped steps' work.
        flushed = self.drafter.flush_context()
        self.drafter.set_depth(plan.depth)
        drafts = super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
            aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)
        draft = self.drafter.take_draft()
        walk = draft.walk_seconds if draft is not None else 0.0
        if torch.is_tensor(drafts) and draft is not None:
            rows = req_ids[: drafts.shape[0]]
            greedy = [self.requests[rid].sampling_params.temperature < GREEDY_EPS for rid in rows]
            lengths = self.dspark.choose(DraftBlocks(rows, draft.confidence, requests.caps()[: len(rows)], greedy))
            drafted, drafts = len(rows), [row[:n] for row, n in zip(drafts.tolist(), lengths)]
        else:
            drafted = len(drafts)
        self._dspark_timing = StepTiming(time.perf_counter() - t0, drafted, flushed, walk)
        return drafts

    def _defer_context(self, contextless, scheduler_output, req_ids, aux_hidden_states, common_attn_metadata):
        """A skipped step: no drafts, but the drafter still takes in this
        step's tokens as context (queued) for the requests that keep it."""
        keep = None
        if contextless:
            keep = [rid not in contextless for rid in req_ids]
            if not any(keep):
                return
        n = scheduler_output.total_num_scheduled_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        step = (aux_hidden_states, self._get_positions(n), common_attn_metadata.slot_mapping[:n], req_ids,
                [scheduled[rid] for rid in req_ids])
        if keep is not None:
            step = _only_requests(step, keep)
        self.drafter.defer_context(*step)


class _Requests:
    """This step's requests as the controller may ask about them (plan.RequestView)."""

    __slots__ = ("req_ids", "_runner", "_outcome", "_caps", "_left")

    def __init__(self, runner, req_ids: list[str], outcome):
        self.req_ids, self._runner, self._outcome, self._caps, self._left = req_ids, runner, outcome, None, None

    def left(self) -> list[int | None]:
        """Tokens each request had left before its max_tokens (None: no
        limit) ahead of this step's: drafting runs before vLLM's bookkeeping
        appends this step's tokens (1 + accepted drafts) to the outputs."""
        if self._left is None:
            states = self._runner.requests
            rows = [states[rid] for rid in self.req_ids]
            self._left = [None if st.sampling_params.max_tokens is None
                          else st.sampling_params.max_tokens - len(st.output_token_ids) for st in rows]
        return self._left

    def caps(self) -> list[int]:
        """dspark_max_verify, and the tokens left after this step's."""
        if self._caps is None:
            outcome, states = self._outcome, self._runner.requests
            produced = [1 + a for a in outcome[1]] if outcome is not None else [1] * len(self.req_ids)
            self._caps = request_caps(
                [states[rid].sampling_params.extra_args for rid in self.req_ids],
                [None if n is None else n - k for n, k in zip(self.left(), produced)], self._runner.drafter.block_len)
        return self._caps


def _only_requests(step: tuple, keep: list[bool]) -> tuple:
    """A skipped step's (aux states, positions, slots, req ids, tokens per
    request) cut to the requests marked in ``keep`` (tokens are request-major)."""
    aux, positions, slots, req_ids, counts = step
    if sum(keep) == 1:  # the usual case while dormant (one request keeps context): views
        i = keep.index(True)
        start = sum(counts[:i])
        rows = slice(start, start + counts[i])
    else:
        rows = torch.repeat_interleave(torch.tensor(keep), torch.tensor(counts)).nonzero().squeeze(1)
        rows = rows.to(positions.device)
    return ([h[rows] for h in aux], positions[rows], slots[rows],
            [r for r, k in zip(req_ids, keep) if k], [c for c, k in zip(counts, keep) if k])


class _LogitsRowsOnly(NamedTuple):
    """What _prepare_inputs reads of the metadata of a step without drafts."""

    logits_indices: torch.Tensor


class DSparkCPUModelRunner(DSparkRunnerMixin, CPUModelRunner):
    pass


class DSparkGPUModelRunner(DSparkRunnerMixin, GPUModelRunner):
    pass
