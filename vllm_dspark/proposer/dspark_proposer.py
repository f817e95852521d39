"""DSparkProposer: DSpark drafting on vLLM's V1 runner.

The parallel stage is vLLM's V1 DFlash machinery, unchanged: target features
are fused and written into the drafter's own KV cache as context, then one
non-causal forward runs the query block. DFlash's block is
``[bonus, mask x n]``; DSpark's is ``[anchor, mask x (K-1)]`` with every slot a
prediction position (the anchor slot predicts the next token), so it is the
DFlash block with n = K-1, sampled at all K slots.

The sequential stage then walks the block left to right: Markov bias from the
previous token, sample (argmax at temperature 0, else from the processed
Markov-corrected distribution), and finally the confidence head scores each
position from its hidden state and the previous token only, which keeps any
cut-off decided from it non-anticipating.

The walk may stop at a depth d < K the controller chose before drafting (the
sequential stage costs one step of small ops per position, whatever the batch
size): positions past d are then never verified. The parallel stage then runs
a block of d positions too (knob ``depth_sized_block``; else K, whose tokens
and confidences past d come from the parallel stage's argmax alone).
"""

import copy
import time
from typing import NamedTuple

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_dspark.config import parse_knobs
from vllm_dspark.layouts import DrafterSpec
from vllm_dspark.log import get_logger
from vllm_dspark.proposer.context_queue import ContextQueue
from vllm_dspark.proposer.drafter_slots import DrafterSlots
from vllm_dspark.sampling import RowParams, inverse_cdf_sample, processed_probs

logger = get_logger(__name__)


class DraftOutput(NamedTuple):
    """One propose()'s blocks, for the runner to hand to the controller."""

    tokens: torch.Tensor  # [B, K] int64; past ``depth`` the parallel stage's argmax
    probs: torch.Tensor | None  # [B, depth, V] float32 draft probabilities (None: every request greedy)
    confidence: torch.Tensor  # [B, K] float32 raw confidence logits
    walk_seconds: float  # the Markov walk's time (its per-position loop)
    depth: int  # positions walked


def _as_method(vllm_config, method: str):
    """A shallow view of ``vllm_config`` whose speculative method reads ``method``."""
    spec = copy.copy(vllm_config.speculative_config)
    object.__setattr__(spec, "method", method)
    view = copy.copy(vllm_config)
    object.__setattr__(view, "speculative_config", spec)
    return view


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place write counter; inference tensors keep none (a
    weight made under inference mode is then keyed by its storage alone)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class DSparkProposer(DFlashProposer):
    _vocab: tuple[int, int] | None = None  # (draft, target) vocabulary sizes when the draft's is reduced
    _kept: torch.Tensor | None = None  # see _target_ids

    def __init__(self, vllm_config, device: torch.device, runner=None):
        # DFlashProposer.__init__ asserts method == "dflash"; its machinery is
        # exactly what DSpark's parallel stage needs, so build it from a view
        # that says "dflash" and keep the real config afterwards. self.method
        # stays "dflash" on purpose: the base class keys DFlash behaviour on it.
        super().__init__(_as_method(vllm_config, "dflash"), device, runner)
        self.vllm_config = vllm_config
        self.speculative_config = vllm_config.speculative_config
        self.block_len = self.speculative_config.num_speculative_tokens  # K
        self.num_speculative_tokens = self.block_len - 1  # masks after the anchor
        self._depth = self.block_len  # positions the Markov head walks on the next propose()
        self._draft: DraftOutput | None = None  # the last propose()'s, until taken
        self.context_queue = ContextQueue(self._write_context)  # skipped steps' context
        self.slots = DrafterSlots()  # which KV slots hold drafter context (for prefix-cache hits)
        self._markov: torch.Tensor | None = None  # see _markov_matrix
        self._markov_key: tuple | None = None
        self._sized_block = parse_knobs(vllm_config.additional_config).depth_sized_block
        spec = DrafterSpec.of(self.speculative_config.draft_model_config.hf_config)
        if spec.reduced_vocab:
            self._vocab = (spec.draft_vocab_size, spec.vocab_size)

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        """Draft one block of K tokens per request: [B, K] token ids.

        The whole draft (confidences, walk time) waits in ``take_draft()`` for
        the runner; the draft probabilities also go where vLLM's runner reads
        them. The runner calls flush_context() first (and times it apart), so
        the skipped steps' context is in the draft KV cache before this step's."""
        k = self.block_len
        # A walk d < K deep needs only d query positions: the block's later
        # masks would be drafted and never verified.
        block = self._depth if self._sized_block else k
        self._last_draft_probs = None
        batch = common_attn_metadata.batch_size()
        context = self.model.combine_hidden_states(target_hidden_states)
        self.num_speculative_tokens = block - 1  # the DFlash machinery lays the block out from it
        try:
            num_tokens, _, cad = self.set_inputs_first_pass(
                target_token_ids=target_token_ids,
                next_token_ids=next_token_ids,
                target_positions=target_positions,
                target_hidden_states=context,
                token_indices_to_sample=None,
                cad=common_attn_metadata,
                num_rejected_tokens_gpu=num_rejected_tokens_gpu,
            )
        finally:
            self.num_speculative_tokens = k - 1
        _, per_layer = self.build_per_group_and_layer_attn_metadata(cad)
        mode, num_input, across_dp = self._determine_batch_execution_and_padding(num_tokens)
        inputs, slot_size = self.build_model_inputs_first_pass(num_tokens, num_input, None)
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=num_input,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=self._get_slot_mapping(slot_size, cad.slot_mapping),
        ):
            hidden = self.model(**inputs)
        self.slots.drafter_wrote(common_attn_metadata.slot_mapping[: target_token_ids.shape[0]])
        # The query rows are request-major: ``block`` consecutive rows per request.
        hidden = hidden[: batch * block].view(batch, block, -1)
        draft = _padded(self._sample_block(hidden, next_token_ids[:batch].long(), sampling_metadata, self._depth,
                                           draws=k), k)
        self._last_draft_probs = draft.probs
        self._draft = draft
        return draft.tokens

    def set_depth(self, depth: int) -> None:
        """The walk depth of the coming propose() (the controller's plan)."""
        self._depth = depth

    def take_draft(self) -> DraftOutput | None:
        """The last propose()'s draft, once (None if there was none since)."""
        draft, self._draft = self._draft, None
        return draft

    def defer_context(self, aux_hidden_states: list[torch.Tensor], positions: torch.Tensor,
                      slot_mapping: torch.Tensor, req_ids: list[str] | None = None,
                      tokens_per_req: list[int] | None = None) -> None:
        """A step without drafting: queue its tokens for the drafter's context
        KV cache (see context_queue.py), so the drafter has no hole in its
        context when drafting resumes."""
        self.context_queue.add(aux_hidden_states, positions, slot_mapping, req_ids, tokens_per_req)

    def flush_context(self) -> float:
        """Write the queued context; returns the seconds it took."""
        if not len(self.context_queue):
            return 0.0
        t0 = time.perf_counter()
        self.context_queue.flush()
        return time.perf_counter() - t0

    @torch.inference_mode()
    def warm_up_context(self, tokens: int) -> None:
        """Run a context write of ``tokens`` rows once, stored nowhere: the fused
        features' projection (combine_hidden_states) at that count, which vLLM's
        dummy pass does not run (runner.warm_up_verify_shapes)."""
        fc = getattr(self.model.model, "fc", None)
        if fc is None or not self.model.model.use_aux_hidden_state:
            return
        features = torch.zeros(tokens, fc.input_size, dtype=fc.weight.dtype, device=self.device)
        positions = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        self.model.precompute_and_store_context_kv(self.model.combine_hidden_states(features), positions)

    @torch.inference_mode()
    def _write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Fused target features -> K/V of every draft layer, into its KV cache."""
        self.model.precompute_and_store_context_kv(self.model.combine_hidden_states(features), positions, slots)
        self.slots.drafter_wrote(slots)

    def _markov_matrix(self, vocab: int) -> torch.Tensor | None:
        """The Markov bias's matrix, [r, vocab] float32, when vLLM's
        markov_bias is the plain product with it (unquantized, one rank, no
        logit scale or soft cap): the walk then adds the bias to the base
        logits in one addmm, where markov_bias, the casts and the add took
        about half of a walk position on CPU (a round of small ops per
        position, whatever the batch). Else None: the walk calls markov_bias.
        Made again whenever the weight changes (a reload)."""
        head = getattr(getattr(self.model, "model", None), "markov_head", None)
        w2 = getattr(head, "markov_w2", None)
        weight = getattr(w2, "weight", None)
        if weight is None:
            return None
        key = (weight.data_ptr(), _version(weight), vocab)
        if self._markov_key != key:
            from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

            lp = getattr(self.model, "logits_processor", None)
            plain = (lp is not None and getattr(lp, "scale", None) == 1.0 and getattr(lp, "soft_cap", 0) is None
                     and not getattr(lp, "logits_as_input", True) and getattr(w2, "tp_size", 0) == 1
                     and isinstance(getattr(w2, "quant_method", None), UnquantizedEmbeddingMethod)
                     and weight.shape[0] >= vocab)
            self._markov = weight[:vocab].float().t().contiguous() if plain else None
            self._markov_key = key
        return self._markov

    def _target_ids(self) -> torch.Tensor | None:
        """For a reduced draft vocabulary (layouts.py), the target id of each
        draft id, [draft vocabulary] int64 (read once the weights are in);
        None when draft ids are target ids."""
        if self._vocab is not None and self._kept is None:
            ids = torch.arange(self._vocab[0], device=self.device)
            self._kept = self.model.map_draft_to_target(ids).long()
        return self._kept

    @torch.inference_mode()
    def _sample_block(self, hidden: torch.Tensor, anchors: torch.Tensor, sampling_metadata,
                      depth: int | None = None, draws: int | None = None) -> DraftOutput:
        """Markov head left to right for ``depth`` positions (default: the
        block's), then the confidence head. hidden [B, block, H]; anchors [B].
        Past ``depth`` the tokens are the parallel stage's argmax and only
        their confidences are of use. ``draws``: uniforms drawn per row
        (default: the block's), K for every block so that the global RNG moves
        alike whatever the depth."""
        batch, k, h = hidden.shape
        depth = k if depth is None else max(1, min(depth, k))
        base = self.model.compute_draft_logits(hidden.reshape(batch * k, h)).view(batch, k, -1).float()
        markov = self._markov_matrix(base.shape[-1])
        # A reduced draft vocabulary: logits and draws over draft ids, tokens
        # (and the next position's Markov input) as target ids, and the draft
        # probabilities placed at target ids for verification, zero elsewhere.
        kept = self._target_ids()
        vocab = self._vocab[1] if kept is not None else base.shape[-1]
        params = RowParams.from_metadata(sampling_metadata, batch, hidden.device)
        sampled = params.any_random
        prev = anchors
        tokens, probs, embeds = [], [], []
        # The draft's own draws come from the global RNG, never from a seeded
        # request's generator: a request that ends up verifying nothing then
        # consumes exactly the draws it would without speculation. K of them
        # at any depth: the first d positions are drawn alike at every depth.
        uniforms = torch.rand(batch, draws or k, device=hidden.device) if sampled else None
        t0 = time.perf_counter()
        for i in range(depth):
            embed = self.model.markov_embed(prev)
            if markov is not None:
                logits = torch.addmm(base[:, i], embed.float(), markov)
            else:
                logits = base[:, i] + self.model.markov_bias(embed).float()
            token = logits.argmax(dim=-1)
            if sampled:
                q = processed_probs(logits, params)
                token = torch.where(params.is_greedy, token, inverse_cdf_sample(q, uniforms[:, i]))
                probs.append(q if kept is None else q.new_zeros(batch, vocab).index_copy_(1, kept, q))
            if kept is not None:
                token = kept[token]
            tokens.append(token)
            embeds.append(embed)
            prev = token
        walk_seconds = time.perf_counter() - t0
        walked = torch.stack(tokens, dim=1)
        embeds = torch.stack(embeds, dim=1)
        if depth < k:
            rest = base[:, depth:].argmax(dim=-1)
            if kept is not None:
                rest = kept[rest]
            walked = torch.cat([walked, rest], dim=1)
            embeds = torch.cat([embeds, self.model.markov_embed(walked[:, depth - 1:k - 1])], dim=1)
        # Raw logits: the controller calibrates them per position.
        conf = self.model.model.confidence_head(
            hidden.reshape(batch * k, h), embeds.reshape(batch * k, -1)
        ).view(batch, k).float()
        draft_probs = torch.stack(probs, dim=1) if sampled else None
        return DraftOutput(walked, draft_probs, conf, walk_seconds, depth)


def _padded(draft: DraftOutput, k: int) -> DraftOutput:
    """A block of fewer than K positions as K: every later position repeats
    its last token and confidence. They are past the walk, so never verified,
    and the skip rule reads no position past a block's walk (survival.py)."""
    extra = k - draft.tokens.shape[1]
    if extra <= 0:
        return draft
    tokens = torch.cat([draft.tokens, draft.tokens[:, -1:].expand(-1, extra)], dim=1)
    conf = torch.cat([draft.confidence, draft.confidence[:, -1:].expand(-1, extra)], dim=1)
    return draft._replace(tokens=tokens, confidence=conf)
