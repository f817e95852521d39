"""vllm_dspark: DSpark confidence-scheduled speculative decoding for vLLM.

Importing this package is cheap on purpose: vLLM imports it in every process
(frontend, engine core, workers) through the ``vllm.general_plugins`` entry
point, so nothing here touches vllm, torch or the environment.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
