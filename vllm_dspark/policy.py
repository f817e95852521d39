"""How many drafted tokens each request verifies this step.

Decided from this step's confidences, which are computed for position j from
tokens before j only: the choice for position j never looks at the token at j,
so verification stays lossless (DSpark paper §4.7).
"""

import torch

from vllm_dspark.config import DSparkKnobs
from vllm_dspark.ops import confidence_cutoff


def verify_lengths(knobs: DSparkKnobs, confidence: torch.Tensor) -> torch.Tensor:
    """[B] int32 verify lengths for confidences [B, K]."""
    batch, k = confidence.shape
    cap = torch.full((batch,), k, dtype=torch.int32, device=confidence.device)
    if knobs.policy == "full":
        return cap
    return confidence_cutoff(confidence, knobs.threshold, cap)
