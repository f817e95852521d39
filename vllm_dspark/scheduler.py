"""DSparkScheduler: vLLM's scheduler, plus the load signals the controller reads."""

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_dspark.controller.signals import ATTR, LoadSignals


class DSparkScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        setattr(out, ATTR, LoadSignals(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_usage=float(self.kv_cache_manager.usage),
            scheduled_tokens=int(out.total_num_scheduled_tokens),
            token_budget=int(self.max_num_scheduled_tokens),
        ))
        return out
