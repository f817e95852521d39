"""The patches in the ledger (compat/ledger.py), applied idempotently.

Config patches run in every process vLLM starts (the front end builds and
validates the config). Worker-side changes are subclasses, installed through
worker_cls, and the two module globals they rebind are rebound only for the
duration of one constructor call. One engine-core helper is memoized
(memoize_replay_boundaries), by DSparkScheduler, in the engine cores that
serve dspark.
"""

import contextlib
import functools

from vllm_dspark.config import MAX_VERIFY_KEY, DSparkConfigError, parse_knobs, refuse_synthetic

_MARK = "__vllm_dspark_wrapped__"
DSPARK_V1_ONLY = "dspark speculative decoding"
SCHEDULER = "vllm_dspark.scheduler.DSparkScheduler"
WORKERS = {
    "vllm.v1.worker.cpu_worker.CPUWorker": "vllm_dspark.workers.cpu.DSparkCPUWorker",
    "vllm.v1.worker.gpu_worker.Worker": "vllm_dspark.workers.gpu.DSparkGPUWorker",
}


@contextlib.contextmanager
def rebound(module, name: str, value):
    """Rebind ``module.name`` to ``value`` for the duration of the block."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _wrap(cls, name: str, make):
    current = getattr(cls, name)
    if getattr(current, _MARK, False):
        return
    wrapped = functools.wraps(current)(make(current))
    setattr(wrapped, _MARK, True)
    setattr(cls, name, wrapped)


def dspark_active(spec) -> bool:
    """method='dspark' served by this plugin (not vLLM's in-tree V2 DSpark)."""
    if spec is None or getattr(spec, "method", None) != "dspark":
        return False
    from vllm import envs as vllm_envs

    return vllm_envs.VLLM_USE_V2_MODEL_RUNNER is not True


def _read_drafter(spec):
    """Before vLLM reads the drafter: it must be a DSpark checkpoint in a
    layout this plugin loads (layouts.py), locally or as a hub id. vLLM would
    otherwise turn any other architecture into a DeepSeek-V4 DSpark draft."""
    from vllm_dspark.layouts import read_drafter

    if spec.model is None:
        raise DSparkConfigError(
            "speculative_config.model is missing: vllm_dspark needs the path or hub id of a "
            "DSpark drafter (e.g. examples/models/tiny-qwen3-dspark). For DeepSeek-V4's "
            "built-in DSpark use vLLM's in-tree runner (VLLM_USE_V2_MODEL_RUNNER=1, GPU)."
        )
    return read_drafter(spec.model, getattr(spec, "revision", None))


def _spec_post_init(original):
    def __post_init__(self):
        drafter = _read_drafter(self) if dspark_active(self) else None
        if drafter is not None:
            refuse_synthetic(self)
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = min(drafter.speculative_tokens or drafter.block_size,
                                                  drafter.block_size)
            # vLLM drops the last block of every prefix-cache hit for hidden-state
            # drafters: EAGLE's K/V at a position mixes in the next token. DSpark's
            # context K/V at a position comes from that position's target features
            # alone, and a block without it admits its request contextless
            # (drafter_slots.py), so the drop only costs hits (a whole 128-token
            # block on CPU: every hit on prompts under 256 tokens).
            if not self.disable_eagle_block_drop:
                self.disable_eagle_block_drop = True
                from vllm_dspark.log import get_logger

                get_logger("config").info(
                    "dspark: prefix-cache hits keep their last block (disable_eagle_block_drop); vLLM's "
                    "warning that this is experimental does not apply to DSpark (docs/prefix_caching.md).")
        original(self)
        if drafter is not None and dspark_active(self):
            from vllm_dspark.layouts import apply, validate_against_target

            apply(drafter, self.draft_model_config.hf_config)
            target = self.target_model_config.hf_text_config
            validate_against_target(
                drafter,
                path=self.model,
                target_vocab_size=target.vocab_size,
                target_hidden_size=target.hidden_size,
                target_num_layers=target.num_hidden_layers,
                num_speculative_tokens=self.num_speculative_tokens,
            )
            _log_kv_share(self.draft_model_config.hf_config, target)

    return __post_init__


def _log_kv_share(draft_cfg, target_cfg) -> None:
    """Say what the drafter's KV costs in tokens, and what holds as many as
    without speculation: under KV pressure that share is lost throughput."""
    from vllm_dspark.layouts import kv_share
    from vllm_dspark.log import get_logger

    share = kv_share(draft_cfg, target_cfg)
    get_logger("config").info(
        "dspark: the drafter's %d attention layers take %.0f%% of each token's KV cache, so at the same KV "
        "cache bytes this engine holds %.2fx the tokens of one without speculation; where the KV cache is "
        "tight (vLLM preempts), give %.2fx the bytes (kv_cache_memory_bytes or --kv-cache-memory-bytes) to "
        "hold as many.", draft_cfg.num_hidden_layers, 100 * share, 1 - share, 1 / (1 - share))


def _vllm_post_init(original):
    def __post_init__(self):
        if dspark_active(self.speculative_config):
            knobs = parse_knobs(self.additional_config)
            _check_confidence_head(self.speculative_config, knobs)
            _route_worker(self.parallel_config)
            if self.scheduler_config.scheduler_cls is None:
                self.scheduler_config.scheduler_cls = SCHEDULER
            if self.scheduler_config.async_scheduling:
                raise DSparkConfigError(
                    "async_scheduling=True is not supported with method='dspark' "
                    "(verify lengths are decided per step); drop --async-scheduling."
                )
            self.scheduler_config.async_scheduling = False
        original(self)
        if dspark_active(self.speculative_config):
            from vllm_dspark.metrics import install_collector

            install_collector(self.instance_id)

    return __post_init__


def _check_confidence_head(spec, knobs) -> None:
    from vllm_dspark.controller.policies import make_policy
    from vllm_dspark.controller.tuning import ControllerTuning

    hf = spec.draft_model_config.hf_config
    needs = make_policy(knobs, ControllerTuning()).needs_confidence_head
    if needs and not getattr(hf, "enable_confidence_head", False):
        raise DSparkConfigError(
            f"additional_config['dspark']['policy']={knobs.policy!r} needs the drafter's "
            f"confidence head, but {spec.model!r} has enable_confidence_head=false; use "
            "policy 'full' or a drafter trained with a confidence head."
        )


def _validate_request(original):
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        spec = getattr(self, "speculative_config", None)
        extra = getattr(params, "extra_args", None)
        if dspark_active(spec) and extra and MAX_VERIFY_KEY in extra:
            value = extra[MAX_VERIFY_KEY]
            k = spec.num_speculative_tokens
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= k:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(
                    f"extra_args[{MAX_VERIFY_KEY!r}]={value!r} is invalid: use an integer "
                    f"from 0 (no speculation for this request) to {k} (num_speculative_tokens).",
                    parameter=f"extra_args.{MAX_VERIFY_KEY}",
                )
        return result

    return _validate_params


def _route_worker(parallel_config) -> None:
    from vllm.platforms import current_platform

    if parallel_config.worker_cls == "auto":
        default = ("vllm.v1.worker.cpu_worker.CPUWorker" if current_platform.is_cpu()
                   else "vllm.v1.worker.gpu_worker.Worker")
        parallel_config.worker_cls = WORKERS[default]
    elif parallel_config.worker_cls not in WORKERS.values():
        raise DSparkConfigError(
            f"worker_cls={parallel_config.worker_cls!r} cannot run method='dspark': "
            f"vllm_dspark needs its own worker ({', '.join(WORKERS.values())}). "
            "Leave worker_cls unset."
        )


def _v1_unsupported(original):
    def _get_v1_model_runner_unsupported_features(self):
        found = original(self)
        if dspark_active(self.speculative_config):
            found = [f for f in found if f != DSPARK_V1_ONLY]
        return found

    return _get_v1_model_runner_unsupported_features


def _v2_unsupported(original):
    def _get_v2_model_runner_unsupported_features(self):
        found = original(self)
        if dspark_active(self.speculative_config):
            found = [*found, "dspark through vllm_dspark (set VLLM_USE_V2_MODEL_RUNNER=1 "
                     "for vLLM's in-tree DSpark)"]
        return found

    return _get_v2_model_runner_unsupported_features


def _post_step(original):
    def post_step(self, model_executed):
        if getattr(self.scheduler, "drafts_in_output", False):
            return  # DSparkScheduler took this step's drafts from its output
        return original(self, model_executed)

    return post_step


def memoize_replay_boundaries() -> None:
    """With a drafter that reads the target's hidden states, vLLM's KV cache
    coordinator works out, for every running request on every step, where a
    later replay of its prompt could resume (a sorted set: about 1.4 us a
    request a step on a 2-core CPU, 23 us of a 4.2 ms dormant step at 16
    requests; a step without speculation does not pay it). The function is pure in
    its three arguments, so it is memoized; called by DSparkScheduler, so
    only engine cores that serve dspark carry it."""
    from vllm.v1.core import kv_cache_coordinator

    _wrap(kv_cache_coordinator, "replay_boundaries", lambda f: functools.lru_cache(maxsize=4096)(f))


def apply_config_patches() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.vllm import VllmConfig
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor

    _wrap(SpeculativeConfig, "__post_init__", _spec_post_init)
    _wrap(VllmConfig, "__post_init__", _vllm_post_init)
    _wrap(VllmConfig, "_get_v1_model_runner_unsupported_features", _v1_unsupported)
    _wrap(VllmConfig, "_get_v2_model_runner_unsupported_features", _v2_unsupported)
    _wrap(InputProcessor, "_validate_params", _validate_request)
    _wrap(EngineCore, "post_step", _post_step)
