"""Worker classes for method='dspark' (one module per platform: importing
vLLM's CPU worker patches torch.cuda process-wide, so it stays out of GPU runs)."""


class DSparkWorkerMixin:
    def dspark_snapshot(self) -> dict:
        """The controller's state (collective_rpc("dspark_snapshot"))."""
        return self.model_runner.dspark_snapshot()
