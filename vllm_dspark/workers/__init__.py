"""Worker classes for method='dspark' (one module per platform: importing
vLLM's CPU worker patches torch.cuda process-wide, so it stays out of GPU runs)."""
