"""DSparkGPUWorker: vLLM's CUDA worker on the V1 runner, building the DSpark runner."""

from vllm.v1.worker import gpu_worker

from vllm_dspark.compat.ledger import check_hooks
from vllm_dspark.workers import DSparkWorkerMixin

check_hooks("worker", "gpu_worker")


class DSparkGPUWorker(DSparkWorkerMixin, gpu_worker.Worker):
    def _make_model_runner(self):
        if self.use_v2_model_runner:
            return super()._make_model_runner()
        from vllm_dspark.runner import DSparkGPUModelRunner

        return DSparkGPUModelRunner(self.vllm_config, self.device)
