"""DSparkCPUWorker: vLLM's CPU worker, building the DSpark model runner and
warming its verify shapes before serving."""

from vllm.v1.worker import cpu_worker

from vllm_dspark.compat.ledger import check_hooks
from vllm_dspark.compat.patches import rebound
from vllm_dspark.log import get_logger
from vllm_dspark.workers import DSparkWorkerMixin

check_hooks("worker", "cpu_worker")
logger = get_logger(__name__)


class DSparkCPUWorker(DSparkWorkerMixin, cpu_worker.CPUWorker):
    def init_device(self):
        from vllm_dspark.runner import DSparkCPUModelRunner

        with rebound(cpu_worker, "CPUModelRunner", DSparkCPUModelRunner):
            super().init_device()

    def compile_or_warm_up_model(self):
        # Before vLLM's, which resets the random seed after its own warm-up.
        top, seconds = self.model_runner.warm_up_verify_shapes()
        if top:
            logger.info("DSpark: ran every verify step size of 1-%d tokens once in %.1f s", top, seconds)
        return super().compile_or_warm_up_model()
