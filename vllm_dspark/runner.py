"""The DSpark model runners: vLLM's V1 runners with DSpark drafting and
variable-length verification.

Three changes, all in subclasses: the drafter is a DSparkProposer, the target
emits the auxiliary hidden states it reads, the rejection sampler is
DSparkRejectionSampler, and each request's block is cut to its verify length
before the scheduler sees it, so the verify batch really shrinks and vLLM's
acceptance metrics count only what was verified.
"""

import torch
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_dspark.compat.patches import rebound
from vllm_dspark.policy import verify_lengths
from vllm_dspark.proposer.dspark_proposer import DSparkProposer
from vllm_dspark.rejection_sampler import DSparkRejectionSampler


class DSparkRunnerMixin:
    def __init__(self, vllm_config, device):
        # For method="dspark" the V1 runner builds an EagleProposer (use_eagle()
        # is true for dspark); have it build ours instead, for this call only.
        with rebound(gpu_model_runner, "EagleProposer", DSparkProposer):
            super().__init__(vllm_config, device)
        assert isinstance(self.drafter, DSparkProposer)
        self.use_aux_hidden_state_outputs = True
        self.rejection_sampler = DSparkRejectionSampler(self.sampler, self.speculative_config, self.device)

    def _get_eagle3_aux_layers_from_config(self):
        # The V1 helper reads only DFlash/EAGLE keys; vLLM's V2 helper also reads
        # DSpark's top-level target_layer_ids (output of layer i = aux layer i+1).
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        return get_eagle3_aux_layers_from_config(self.speculative_config)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts = super().propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs)
        confidence = self.drafter.last_confidence
        self.drafter.last_confidence = None
        if not torch.is_tensor(drafts) or confidence is None:
            return drafts
        lengths = verify_lengths(self.drafter.knobs, confidence).tolist()
        return [row[:n] for row, n in zip(drafts.tolist(), lengths)]


class DSparkCPUModelRunner(DSparkRunnerMixin, CPUModelRunner):
    pass


class DSparkGPUModelRunner(DSparkRunnerMixin, GPUModelRunner):
    pass
