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
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_dspark import envs
from vllm_dspark.log import get_logger
from vllm_dspark.compat.ledger import check_instance
from vllm_dspark.compat.patches import rebound
from vllm_dspark.config import parse_knobs
from vllm_dspark.controller.controller import DSparkController
from vllm_dspark.controller.cost_model import fingerprint
from vllm_dspark.metrics import SnapshotWriter, snapshot_dir, summary_line
from vllm_dspark.proposer.dspark_proposer import DSparkProposer
from vllm_dspark.rejection_sampler import DSparkRejectionSampler
from vllm_dspark.sampling import GREEDY_EPS
from vllm_dspark.scheduler import DRAFTS_ATTR

logger = get_logger(__name__)


class DSparkRunnerMixin:
    def __init__(self, vllm_config, device):
        # For method="dspark" the V1 runner builds an EagleProposer (use_eagle()
        # is true for dspark); have it build ours instead, for this call only.
        with rebound(gpu_model_runner, "EagleProposer", DSparkProposer):
            super().__init__(vllm_config, device)
        assert isinstance(self.drafter, DSparkProposer)
        # Requests admitted while the controller was dormant: never drafted,
        # and their context is neither queued nor written.
        self._contextless: set[str] = set()
        self.drafter.context_queue.live_requests = _WantedContext(self.requests, self._contextless)
        self.use_aux_hidden_state_outputs = True
        self.rejection_sampler = DSparkRejectionSampler(self.sampler, self.speculative_config, self.device)
        knobs = parse_knobs(vllm_config.additional_config)
        self.dspark = DSparkController(knobs, self.drafter.block_len, _cost_fingerprint(vllm_config),
                                       cache_dir=_cache_dir(), trace_dir=envs.VLLM_DSPARK_TRACE_DIR)
        rank = vllm_config.parallel_config.rank
        # This step's drafting: (seconds, requests drafted, seconds of them
        # spent writing skipped steps' queued context, and walking the Markov head).
        self._dspark_draft = (0.0, 0, 0.0, 0.0)
        self._dspark_snapshots = SnapshotWriter(
            snapshot_dir(vllm_config.instance_id) if rank == 0 else None, rank, self.dspark.snapshot)
        check_instance(self, "runner")  # the attributes _set_plain switches
        # Steps while the controller is dormant run as steps without
        # speculation (see _set_plain): not for hybrid targets (their state
        # tracking reads the speculative config) nor with CUDA graphs (captured
        # with it); the target's aux outputs go too only where it runs eagerly
        # (a compiled forward keeps the outputs it was traced with).
        compilation = vllm_config.compilation_config
        self._plain = False
        self._plain_allowed = (not vllm_config.model_config.is_hybrid
                               and compilation.cudagraph_mode == CUDAGraphMode.NONE)
        self._plain_aux = compilation.mode == CompilationMode.NONE
        self._spec_config = self.speculative_config
        self._plain_step_output = None

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

    def execute_model(self, scheduler_output, *args, **kwargs):
        self.dspark.step_started(scheduler_output)
        if self.rejection_sampler.last_outcome is not None:  # (nn.Module setattr is slow)
            self.rejection_sampler.last_outcome = None
        plain = (self._plain_allowed and self.dspark.dormant
                 and not scheduler_output.scheduled_spec_decode_tokens)
        if plain != self._plain:
            self._set_plain(plain)
        self._plain_step_output = scheduler_output if plain else None
        return super().execute_model(scheduler_output, *args, **kwargs)

    def _set_plain(self, on: bool) -> None:
        """Run the coming steps as vLLM runs them without speculation (on), or
        with it again. While the controller is dormant no step drafts, and
        vLLM's speculative paths (verify metadata, the drafter's attention
        metadata and hook, the target's aux hidden states) were most of what a
        dormant DSpark step cost over a step without speculation. Such a step
        gives the drafter no context: every request in it loses its context
        (_after_plain_step)."""
        self._plain = on
        self.speculative_config = None if on else self._spec_config
        if self._plain_aux:
            self.use_aux_hidden_state_outputs = not on
            layers = () if on else (self._get_eagle3_aux_layers_from_config()
                                    or self.model.get_eagle3_default_aux_hidden_state_layers())
            self.model.set_aux_hidden_state_layers(layers)

    def _after_plain_step(self, scheduler_output) -> None:
        """Bookkeeping of a step run without speculation: no request in it
        keeps drafter context, and the skip rule still runs (it is what ends
        dormancy)."""
        scheduled = scheduler_output.num_scheduled_tokens  # this step's requests, by id
        self._forget_finished(scheduler_output)
        if scheduler_output.scheduled_new_reqs:
            self.dspark.admitted_without_context(len(scheduler_output.scheduled_new_reqs))
        self._contextless.update(scheduled)
        self.dspark.ran_plain_step()
        self.dspark.should_skip_drafting(len(scheduled), None, _no_context)

    def sample_tokens(self, *args, **kwargs):
        self._dspark_draft = (0.0, 0, 0.0, 0.0)
        plain_step, self._plain_step_output = self._plain_step_output, None
        out = super().sample_tokens(*args, **kwargs)
        if plain_step is not None:
            self._after_plain_step(plain_step)
        elif isinstance(out, ModelRunnerOutput):
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
        self.dspark.step_finished(*self._dspark_draft)
        every = self.dspark.knobs.log_every
        if every and self.dspark.steps and self.dspark.steps % every == 0:
            logger.info(summary_line(self.dspark.snapshot()))
        return out

    def propose_draft_token_ids(self, *args, **kwargs):
        # The whole drafting path (vLLM's input preparation included) is timed:
        # it is what skipping the drafter saves.
        t0 = time.perf_counter()
        self.drafter.last_walk_seconds = 0.0
        drafts, drafted, flushed = self._dspark_propose(*args, **kwargs)
        self._dspark_draft = (time.perf_counter() - t0, drafted, flushed, self.drafter.last_walk_seconds)
        return drafts

    def _dspark_propose(self, scheduler_output, sampled_token_ids, sampling_metadata,
                        hidden_states, sample_hidden_states, aux_hidden_states,
                        spec_decode_metadata, common_attn_metadata, slot_mappings):
        """(drafts per request, blocks drafted, seconds spent writing queued
        context). Blocks count even when the controller then verifies none of
        them: the drafting model must learn from those steps too (else, when
        no length pays, it never becomes trusted and probes never back off)."""
        req_ids = list(self.input_batch.req_ids)
        outcome = self.rejection_sampler.last_outcome
        if outcome is not None:
            self.dspark.verified(req_ids, *outcome)
        caps = _Once(lambda: self._request_caps(req_ids, outcome))
        draftable = _Once(lambda: self._admit(scheduler_output, req_ids))
        if self.dspark.should_skip_drafting(len(req_ids), caps, draftable):
            # Speculation does not pay at this load: no block, no drafts; the
            # drafter still takes in this step's tokens as context (queued),
            # unless no request here keeps context.
            with_context = draftable()
            if with_context:
                n = scheduler_output.total_num_scheduled_tokens
                scheduled = scheduler_output.num_scheduled_tokens
                step = (aux_hidden_states, self._get_positions(n), common_attn_metadata.slot_mapping[:n],
                        req_ids, [scheduled[rid] for rid in req_ids])
                if with_context < len(req_ids):
                    step = _only_requests(step, [rid not in self._contextless for rid in req_ids])
                self.drafter.defer_context(*step)
            return [[] for _ in req_ids], 0, 0.0
        # The context queued by skipped steps is written first and timed apart:
        # it is the skipped steps' work, and counted as drafting it made a
        # probe after a long skip look up to twice as dear as drafting is.
        flushed = self.drafter.flush_context()
        self.drafter.depth = self.dspark.depth
        drafts = super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
            aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)
        confidence = self.drafter.last_confidence
        self.drafter.last_confidence = None
        if not torch.is_tensor(drafts) or confidence is None:
            return drafts, len(drafts), flushed
        rows = req_ids[: drafts.shape[0]]
        greedy = [self.requests[rid].sampling_params.temperature < GREEDY_EPS for rid in rows]
        lengths = self.dspark.choose(rows, confidence, caps()[: len(rows)], greedy)
        return [row[:n] for row, n in zip(drafts.tolist(), lengths)], len(rows), flushed

    def _admit(self, scheduler_output, req_ids: list[str]) -> int:
        """Track the requests without drafter context: this step's new ones
        if the controller is dormant, less those that finished, and except
        one while no other request here has context (probes need one: they
        are what tells when drafting pays again). Returns how many of
        ``req_ids`` have context."""
        self._forget_finished(scheduler_output)
        contextless = self._contextless
        if self.dspark.dormant and scheduler_output.scheduled_new_reqs:
            new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            fresh = set(new)
            if not any(rid not in contextless and rid not in fresh for rid in req_ids):
                new = new[1:]
            contextless.update(new)
            self.dspark.admitted_without_context(len(new))
        return len(req_ids) - sum(rid in contextless for rid in req_ids) if contextless else len(req_ids)

    def _forget_finished(self, scheduler_output) -> None:
        """Requests that finished hold no context to track."""
        if self._contextless and scheduler_output.finished_req_ids:
            self._contextless.difference_update(scheduler_output.finished_req_ids)

    def _request_caps(self, req_ids: list[str], outcome) -> list[int]:
        """Each request's verify cap: its dspark_max_verify, and the tokens
        left before its max_tokens; 0 without drafter context. Drafting runs
        before vLLM's bookkeeping appends this step's tokens (1 + accepted
        drafts) to the outputs."""
        produced = [1 + a for a in outcome[1]] if outcome is not None else [1] * len(req_ids)
        states = [self.requests[rid] for rid in req_ids]
        params = [st.sampling_params for st in states]
        caps = self.dspark.request_caps(
            [p.extra_args for p in params],
            [None if p.max_tokens is None else p.max_tokens - len(st.output_token_ids) - k
             for p, st, k in zip(params, states, produced)])
        contextless = self._contextless
        return [0 if rid in contextless else c for rid, c in zip(req_ids, caps)] if contextless else caps


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


class _Once:
    """A call computed on first use, then remembered (functools.cache builds
    a wrapper per instance, dearer than the two calls a step makes)."""

    __slots__ = ("_fn", "_value")
    _UNSET = object()

    def __init__(self, fn):
        self._fn, self._value = fn, _Once._UNSET

    def __call__(self):
        if self._value is _Once._UNSET:
            self._value = self._fn()
        return self._value


def _no_context() -> int:
    return 0


class _WantedContext:
    """The request ids whose queued context is still written: live, and
    admitted with context."""

    def __init__(self, requests: dict, contextless: set[str]):
        self._requests, self._contextless = requests, contextless

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests and req_id not in self._contextless


class _LogitsRowsOnly(NamedTuple):
    """What _prepare_inputs reads of the metadata of a step without drafts."""

    logits_indices: torch.Tensor


def _cost_fingerprint(vllm_config) -> str:
    from vllm_dspark.benchmarking import machine_info

    info = machine_info()
    spec = vllm_config.speculative_config
    return fingerprint(info["cpu"], info["cores"], info["versions"], vllm_config.model_config.model,
                       vllm_config.model_config.dtype, spec.model, spec.num_speculative_tokens,
                       vllm_config.parallel_config.tensor_parallel_size)


def _cache_dir():
    from pathlib import Path

    return Path(envs.VLLM_DSPARK_CACHE_DIR)


class DSparkCPUModelRunner(DSparkRunnerMixin, CPUModelRunner):
    pass


class DSparkGPUModelRunner(DSparkRunnerMixin, GPUModelRunner):
    pass
