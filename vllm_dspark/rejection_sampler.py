"""DSparkRejectionSampler: lossless verification of variable-length drafts.

Subclasses vLLM's V1 RejectionSampler and keeps its bonus-token sampling
(vLLM's Sampler: penalties, seeds, top-k/top-p/min-p), its logits processors
for the draft positions and its logprobs. What it replaces is the per-token
part: sampling parameters are expanded in torch (sampling.py) instead of
through vLLM's CPU expand kernel, min-p is applied (the stock V1 verifier
skips it), and acceptance and recovery go through this package's ops.

Per request r with n_r drafts x_1..x_n (n_r may be 0..K, different per row):
  * greedy: accept while x_i equals the target argmax; at the first mismatch
    emit the argmax; if all pass, emit the bonus token;
  * sampled: accept x_i with probability min(1, p_i(x_i)/q_i(x_i)); at the
    first rejection emit a token drawn from norm(max(p_i - q_i, 0)); if all
    pass, emit the bonus token drawn from p_{n+1}.
Seeded requests draw every uniform from their own generator.
"""

from dataclasses import replace

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

from vllm_dspark import ops
from vllm_dspark.config import refuse_synthetic
from vllm_dspark.sampling import RowParams, processed_probs, row_uniforms


class DSparkRejectionSampler(RejectionSampler):
    def __init__(self, sampler, spec_config=None, *args, **kwargs):
        refuse_synthetic(spec_config)
        super().__init__(sampler, spec_config, *args, **kwargs)
        # (num_verified per request, accepted per request) of this forward, for the controller.
        self.last_outcome: tuple[list[int], list[int]] | None = None

    def take_outcome(self) -> tuple[list[int], list[int]] | None:
        """This forward's outcome, once."""
        outcome = self.last_outcome
        if outcome is not None:
            self.last_outcome = None
        return outcome

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        self.last_outcome = None
        counts = list(metadata.num_draft_tokens)
        num_reqs = len(counts)
        device = logits.device
        bonus_out = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits",
        )
        bonus = bonus_out.sampled_token_ids.view(-1)
        out = torch.full((num_reqs, metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                         dtype=torch.int32, device=device)

        raw_target = logits[metadata.target_logits_indices].float()
        # The processors below work in place; the raw logits are kept only
        # for raw logprobs.
        keep_raw = sampling_metadata.max_num_logprobs is not None and not self.is_processed_logprobs_mode
        target = raw_target.clone() if keep_raw else raw_target
        if raw_target.shape[0] == 0:
            out[:, 0] = bonus
        else:
            target = self.apply_logits_processors(target, sampling_metadata, metadata)
            if sampling_metadata.all_greedy and device.type == "cpu":
                self._verify_greedy(out, counts, metadata.draft_token_ids, target, bonus)
            else:
                self._verify(out, counts, metadata.draft_token_ids.long(), draft_probs, target,
                             bonus, sampling_metadata)

        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits,
                target if self.is_processed_logprobs_mode else raw_target,
                bonus_out.logprobs_tensors.logprobs, out,
            )
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

    def _verify_greedy(self, out, counts, drafts, target, bonus) -> None:
        """Every row greedy, on CPU: _verify's greedy rule over Python lists.
        Each small torch op costs ~10 us inside a CPU engine and the tensor
        path runs about thirty of them (0.8 ms a verify step at batch 1);
        the lists are at most R x K long."""
        argmax = target.argmax(dim=-1).tolist()
        draft, bonus = drafts.tolist(), bonus.tolist()
        width = out.shape[1]
        rows, accepted = [], []
        start = 0
        for r, n in enumerate(counts):
            a = 0
            while a < n and draft[start + a] == argmax[start + a]:  # a -1 (padded) draft never matches
                a += 1
            row = draft[start:start + a] + [argmax[start + a] if a < n else bonus[r]]
            rows.append(row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)))
            accepted.append(a)
            start += n
        out.copy_(torch.tensor(rows, dtype=out.dtype))
        self.last_outcome = (counts, accepted)

    def _verify(self, out, counts, drafts, draft_probs, target, bonus, sampling_metadata) -> None:
        device = target.device
        num_reqs = len(counts)
        count_t = torch.tensor(counts, device=device)
        cu = torch.cumsum(count_t, 0).to(torch.int32)
        req_params = RowParams.from_metadata(sampling_metadata, num_reqs, device)
        params = req_params.repeat(count_t)
        valid = drafts >= 0  # -1 marks a padded slot: always rejected
        safe = drafts.clamp(min=0)
        argmax = target.argmax(dim=-1)

        if req_params.any_random:
            p = processed_probs(target, params)
            p_x = p.gather(1, safe[:, None]).squeeze(1)
            q_x = draft_probs.gather(1, safe[:, None]).squeeze(1) if draft_probs is not None else torch.ones_like(p_x)
            p_x = torch.where(valid, p_x, torch.zeros_like(p_x))
            accept_u = row_uniforms(counts, sampling_metadata.generators, device)
            # One more uniform per request that has drafts (a request without
            # drafts draws nothing here, so its stream matches no speculation).
            has = [1 if n else 0 for n in counts]
            recover_u = torch.zeros(num_reqs, device=device)
            recover_u[torch.tensor(has, dtype=torch.bool, device=device)] = row_uniforms(
                has, sampling_metadata.generators, device)
        else:
            p = None
            p_x = q_x = accept_u = torch.zeros(drafts.shape[0], device=device)
            recover_u = torch.zeros(num_reqs, device=device)

        # argmax >= 0, so a padded -1 draft never matches it.
        accepted = ops.rejection_accept(p_x, q_x, drafts, argmax, accept_u, cu, req_params.is_greedy)
        self.last_outcome = (counts, accepted.tolist())
        acc = accepted.long()
        starts = cu.long() - count_t
        rejected = acc < count_t
        next_tok = bonus.long().clone()
        if bool(rejected.any()):
            rows = (starts + acc)[rejected]
            rec = argmax[rows]
            random_rows = ~req_params.is_greedy[rejected]
            if bool(random_rows.any()):
                r_rows = rows[random_rows]
                if draft_probs is not None:
                    q_rows = draft_probs[r_rows].float()
                else:  # deterministic drafts: q is one-hot at the draft
                    q_rows = torch.nn.functional.one_hot(safe[r_rows], p.shape[1]).float()
                # A padded (-1) slot drafted nothing: its correction is drawn from p.
                q_rows = q_rows * valid[r_rows, None]
                rec[random_rows] = ops.sample_recovered(
                    p[r_rows], q_rows, safe[r_rows], recover_u[rejected][random_rows])
            next_tok[rejected] = rec
        # Assemble: accepted drafts, then the recovered or bonus token.
        cols = torch.arange(out.shape[1], device=device)
        idx = (starts[:, None] + cols[None, :]).clamp(max=max(drafts.shape[0] - 1, 0))
        keep = cols[None, :] < acc[:, None]
        out.copy_(torch.where(keep, drafts[idx].to(out.dtype), out))
        out.scatter_(1, acc[:, None], next_tok[:, None].to(out.dtype))
