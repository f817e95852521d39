"""DSparkCPUWorker: vLLM's CPU worker, building the DSpark model runner."""

from vllm.v1.worker import cpu_worker

from vllm_dspark.compat.ledger import check_hooks
from vllm_dspark.workers import DSparkWorkerMixin
from vllm_dspark.compat.patches import rebound

check_hooks("worker", "cpu_worker")


class DSparkCPUWorker(DSparkWorkerMixin, cpu_worker.CPUWorker):
    def init_device(self):
        from vllm_dspark.runner import DSparkCPUModelRunner

        with rebound(cpu_worker, "CPUModelRunner", DSparkCPUModelRunner):
            super().init_device()
