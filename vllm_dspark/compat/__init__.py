"""Everything vllm_dspark touches inside vLLM: the ledger and the patches."""
