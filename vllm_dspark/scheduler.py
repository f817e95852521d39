"""DSparkScheduler: vLLM's scheduler, plus the load signals the controller
reads, and the step's draft tokens taken from the model output.

vLLM's engine core asks the worker for the new draft tokens after every step
(EngineCore.post_step -> take_draft_token_ids), one more round trip between
processes per step. On a 2-core CPU it cost about 0.5 ms a step (the worker's
wait between steps at batch 1 went from 0.4 ms without speculation to 0.9 ms
with it, and back to 0.4 ms without the round trip). DSpark workers therefore
send the drafts with the step's output (runner.py), this scheduler applies
them where vLLM would have, right after the step's output, and post_step
skips the round trip (compat/patches.py).

vLLM reserves KV slots for K tokens past every running request's on every
step: a block's drafts are written there. A dormant engine drafts nothing,
so while the worker says so (SLOTS_ATTR on its output, sent when it
changes) no slots are reserved: under KV pressure that is about K tokens a
request more for the batch. The step says whether they were (LoadSignals.
draft_slots), and the controller drafts only on a step that has them.
"""

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_dspark.compat.ledger import check_instance
from vllm_dspark.compat.patches import memoize_replay_boundaries
from vllm_dspark.controller.signals import ATTR, LoadSignals

# ModelRunnerOutput attribute that carries the step's DraftTokenIds (or None).
DRAFTS_ATTR = "dspark_draft_token_ids"
# ModelRunnerOutput attribute: whether the coming steps may draft (sent when it changes).
SLOTS_ATTR = "dspark_draft_slots"


class DSparkScheduler(Scheduler):
    # Read by the EngineCore.post_step wrap: drafts come with the output.
    drafts_in_output = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_instance(self, "scheduler-state")
        self._lookahead = self.num_lookahead_tokens  # vLLM's reservation for a block's drafts
        memoize_replay_boundaries()

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        setattr(out, ATTR, LoadSignals(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_usage=float(self.kv_cache_manager.usage),
            scheduled_tokens=int(out.total_num_scheduled_tokens),
            token_budget=int(self.max_num_scheduled_tokens),
            max_running=int(self.max_num_running_reqs),
            draft_slots=self.num_lookahead_tokens == self._lookahead,
        ))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        drafts = getattr(model_runner_output, DRAFTS_ATTR, None)
        if drafts is not None:
            self.update_draft_token_ids(drafts)
        may_draft = getattr(model_runner_output, SLOTS_ATTR, None)
        if may_draft is not None:
            self.num_lookahead_tokens = self._lookahead if may_draft else 0
        return outputs
