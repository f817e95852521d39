"""The ledger: every vLLM internal vllm_dspark wraps, subclasses, rebinds or
relies on, why, and when it can go. :func:`check_hooks` runs at start-up
(plugin registration) and fails with one message listing every drift from
the pinned vLLM, instead of failing mid-decode.
"""

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Hook:
    symbol: str  # dotted path: module[.Class].attribute
    kind: str  # "wrap" | "subclass" | "rebind" | "call"
    why: str
    replaces: str
    remove_when: str
    params: tuple[str, ...] | None = None  # expected leading parameter names (callables)
    # Where it is checked: "config" in every process at registration; the others
    # when the worker side loads (importing vLLM's worker modules in the front
    # end would, on CPU, patch torch.cuda there).
    scope: str = "worker"


_UPSTREAM = "vLLM's V1 runner gains DSpark drafting and variable-length verification"

LEDGER: tuple[Hook, ...] = (
    Hook(
        "vllm.config.speculative.SpeculativeConfig.__post_init__", "wrap",
        "Check a dspark drafter path and checkpoint before vLLM rewrites an "
        "unknown architecture to DeepSeek-V4 DSpark, and check it against the target.",
        "nothing (vLLM's own post-init runs unchanged in between)",
        "vLLM validates DSpark checkpoints itself", ("self",),
        scope="config",
    ),
    Hook(
        "vllm.config.speculative.SpeculativeConfig.disable_eagle_block_drop", "call",
        "Set for dspark: prefix-cache hits keep their last block (DSpark's context "
        "K/V has no next-token dependence; stale blocks are tracked per slot).",
        "-", "-", None, scope="config",
    ),
    Hook(
        "vllm.config.speculative.SpeculativeConfig.rejection_sample_method", "call",
        "Read for dspark: 'synthetic' is refused at start-up and by DSparkRejectionSampler "
        "(it accepts at fixed rates, whatever the target says).", "-", "-", None, scope="config",
    ),
    Hook(
        "vllm.config.speculative.SpeculativeConfig.revision", "call",
        "The revision a hub-id drafter's config.json is read at (layouts.locate).",
        "-", "-", None, scope="config",
    ),
    Hook(
        "vllm.config.vllm.VllmConfig.__post_init__", "wrap",
        "Validate additional_config['dspark'], keep scheduling synchronous and "
        "point worker_cls at the DSpark worker for method='dspark'.",
        "nothing (runs before and after vLLM's post-init)", _UPSTREAM, ("self",),
        scope="config",
    ),
    Hook(
        "vllm.config.vllm.VllmConfig._get_v1_model_runner_unsupported_features", "wrap",
        "vLLM lists 'dspark speculative decoding' as unsupported on the V1 runner; "
        "vllm_dspark supports it there.",
        "the list minus that one entry", _UPSTREAM, ("self",),
        scope="config",
    ),
    Hook(
        "vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features", "wrap",
        "Route dspark to the V1 runner (where vllm_dspark runs) unless the user "
        "asks for the V2 runner with VLLM_USE_V2_MODEL_RUNNER=1 (in-tree DSpark).",
        "the list plus one entry", _UPSTREAM, ("self",),
        scope="config",
    ),
    Hook(
        "vllm.v1.engine.input_processor.InputProcessor._validate_params", "wrap",
        "Reject a bad per-request extra_args['dspark_max_verify'] at admission "
        "(HTTP 400 / ValueError), not mid-decode.", "nothing (runs after vLLM's checks)",
        "vLLM validates speculative per-request settings", ("self", "params"), scope="config",
    ),
    Hook(
        "vllm.v1.engine.core.EngineCore.post_step", "wrap",
        "Skip the engine core's per-step take_draft_token_ids round trip to the "
        "worker when DSparkScheduler already took the drafts from the step's output "
        "(on a 2-core CPU that round trip cost about 0.5 ms a step).",
        "the round trip, only when the scheduler is DSparkScheduler",
        "vLLM returns drafts with the model output in synchronous scheduling",
        ("self", "model_executed"), scope="config",
    ),
    Hook(
        "vllm.v1.core.sched.scheduler.Scheduler.update_from_output", "subclass",
        "DSparkScheduler applies the draft tokens the DSpark worker sent with the "
        "step's output, where post_step would have.",
        "nothing (calls super, then update_draft_token_ids)",
        "vLLM returns drafts with the model output in synchronous scheduling",
        ("self", "scheduler_output", "model_runner_output"),
    ),
    Hook(
        "vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids", "call",
        "Applies the drafts carried by the model output.", "-", "-", ("self", "draft_token_ids"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.take_draft_token_ids", "call",
        "The DSpark runner attaches this step's drafts to its output.", "-", "-", ("self",),
    ),
    Hook(
        "vllm.v1.outputs.ModelRunnerOutput", "call",
        "The step output that carries the drafts (as one extra attribute, on a copy).",
        "-", "-", None,
    ),
    Hook(
        "vllm.v1.core.sched.scheduler.Scheduler.schedule", "subclass",
        "DSparkScheduler stamps queue depth, KV usage and token budget onto each "
        "SchedulerOutput (installed as scheduler_cls for dspark runs).",
        "nothing (calls super, then adds one attribute)", _UPSTREAM, ("self",),
    ),
    Hook(
        "vllm.v1.core.sched.scheduler.Scheduler.num_lookahead_tokens", "rebind",
        "Read by schedule() for every request's KV slots past its tokens, which a block's "
        "drafts are written to: DSparkScheduler sets it to 0 while the worker says no step "
        "will draft (the controller is dormant), and back to vLLM's value after.",
        "the attribute, between two steps", "vLLM reserves draft slots only for steps that draft",
        None, scope="scheduler-state",
    ),
    Hook(
        "vllm.v1.core.kv_cache_coordinator.replay_boundaries", "wrap",
        "Recomputed for every running request on every step once a drafter reads "
        "target hidden states (about 1.4 us a request on a 2-core CPU: 23 us, half a "
        "percent of a dormant step, at 16 requests); pure in its arguments, so "
        "DSparkScheduler memoizes it in its engine core.",
        "nothing (an lru_cache in front of vLLM's function)",
        "vLLM computes the boundaries once per request",
        ("num_prompt_tokens", "scheduler_block_size", "use_eagle"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model", "subclass",
        "Marks the start of a step for the controller's step timing and load signals.",
        "nothing (calls super)", _UPSTREAM, ("self", "scheduler_output"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._calc_spec_decode_metadata", "subclass",
        "vLLM's V1 runner builds verify metadata on every step once speculation is "
        "configured; for a step in which no request has drafts only the logits rows "
        "(each request's last token) are computed.",
        "the method, for steps without drafts (calls super otherwise)",
        "vLLM's V1 runner skips the verify path on steps without drafts",
        ("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs", "subclass",
        "A step without drafts returns no spec-decode metadata, so it samples through "
        "vLLM's plain Sampler and is bookkept like a step without speculation (about "
        "0.2 ms a step on a 2-core CPU, with the method above).",
        "nothing (calls super, then drops the metadata of a draft-free step)",
        "vLLM's V1 runner skips the verify path on steps without drafts",
        ("self", "scheduler_output", "num_scheduled_tokens"),
    ),
    Hook(
        "vllm.distributed.parallel_state.get_tp_group", "call",
        "Under tensor parallelism every rank's controller learns from rank 0's step "
        "timings (rank_sync.py), so all ranks draft, skip and run plain steps alike.", "-", "-", (),
    ),
    Hook(
        "vllm.distributed.parallel_state.GroupCoordinator.broadcast", "call",
        "Sends rank 0's step timings and decisions (plain step, skip and depth, verify lengths) to the "
        "other ranks.", "-", "-", ("self", "input_", "src"),
    ),
    Hook(
        "vllm.utils.torch_utils.async_tensor_h2d", "call",
        "Copies a draft-free step's logits rows to the device.", "-", "-",
        ("data", "device"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens", "subclass",
        "Marks the end of a step (timing, metrics snapshot, periodic log).",
        "nothing (calls super)", _UPSTREAM, ("self",),
    ),
    Hook(
        "vllm.v1.worker.cpu_worker.CPUWorker", "subclass",
        "DSparkCPUWorker builds the DSpark model runner.", "init_device (calls super)",
        _UPSTREAM, None, scope="cpu_worker",
    ),
    Hook(
        "vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model", "subclass",
        "DSparkCPUWorker runs every verify step size of a few requests once first "
        "(runner.warm_up_verify_shapes): on CPU a token count's first run builds its kernels.",
        "nothing (calls super)", "vLLM's CPU worker warms the token counts speculation verifies",
        ("self",), scope="cpu_worker",
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._dummy_run", "call",
        "warm_up_verify_shapes runs the target and the drafter's dummy pass at each token count.",
        "-", "-", ("self", "num_tokens"),
    ),
    Hook(
        "vllm.v1.worker.cpu_worker.CPUModelRunner", "rebind",
        "Module global that CPUWorker.init_device instantiates; rebound to the DSpark "
        "runner only while DSparkCPUWorker.init_device runs.", "the runner class",
        _UPSTREAM, ("vllm_config", "device"), scope="cpu_worker",
    ),
    Hook(
        "vllm.v1.worker.gpu_worker.Worker._make_model_runner", "subclass",
        "DSparkGPUWorker builds the DSpark model runner (CUDA, V1 runner).",
        "the V1 branch of the method", _UPSTREAM, ("self",), scope="gpu_worker",
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.EagleProposer", "rebind",
        "The V1 runner builds an EagleProposer for method='dspark' (use_eagle() is "
        "true); rebound to DSparkProposer only while the DSpark runner's __init__ runs.",
        "the drafter class", _UPSTREAM, ("vllm_config", "device", "runner"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids", "subclass",
        "Cut each request's block to its verify length and hand the scheduler "
        "variable-length draft lists.", "nothing (calls super, then truncates)", _UPSTREAM,
        ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
         "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
         "common_attn_metadata", "slot_mappings"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_eagle3_aux_layers_from_config",
        "subclass",
        "The V1 version ignores DSpark's top-level target_layer_ids and would tap "
        "the target's default EAGLE3 layers.", "the method (delegates to the V2 helper below)",
        _UPSTREAM, ("self",),
    ),
    Hook(
        "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils.get_eagle3_aux_layers_from_config",
        "call", "Maps a DSpark checkpoint's target_layer_ids to the target's aux layers.",
        "-", "-", ("spec_config",),
    ),
    Hook(
        "vllm.v1.spec_decode.dflash.DFlashProposer", "subclass",
        "DSparkProposer reuses the V1 DFlash machinery (context KV injection into the "
        "draft KV cache, non-causal query block) and replaces sampling with the "
        "Markov head and confidence head.", "propose", "never (intended extension)",
        ("vllm_config", "device", "runner"),
    ),
    Hook(
        "vllm.v1.spec_decode.dflash.DFlashProposer.set_inputs_first_pass", "call",
        "Builds the [anchor, mask...] query block and its KV slots.", "-", "-",
        ("self", "target_token_ids", "next_token_ids", "target_positions",
         "target_hidden_states", "token_indices_to_sample", "cad", "num_rejected_tokens_gpu"),
    ),
    Hook(
        "vllm.v1.spec_decode.dflash.DFlashProposer.build_model_inputs_first_pass", "call",
        "Writes the context K/V into the draft KV cache.", "-", "-",
        ("self", "num_tokens", "num_input_tokens", "mm_embed_inputs"),
    ),
    Hook(
        "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer.propose", "subclass",
        "Overridden by DSparkProposer.propose with the same parameters.", "propose", "-",
        ("self", "num_speculative_tokens", "target_token_ids", "target_positions",
         "target_hidden_states", "next_token_ids", "token_indices_to_sample",
         "common_attn_metadata", "sampling_metadata", "mm_embed_inputs",
         "num_rejected_tokens_gpu", "slot_mappings"),
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM", "call",
        "In-tree DSpark draft model: backbone, Markov head, confidence head, weight loading.",
        "-", "-", None,
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM.precompute_and_store_context_kv", "call",
        "Writes the queued context of skipped steps into the draft KV cache in one batch; "
        "without slots (stores nothing) in the start-up warm-up.",
        "-", "-", ("self", "context_states", "context_positions", "context_slot_mapping"),
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM.combine_hidden_states", "call",
        "Fuses the target's auxiliary hidden states into the drafter's context features "
        "(its fc's input_size sizes the warm-up's features).",
        "-", "-", ("self", "hidden_states"),
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM.compute_draft_logits", "call",
        "Parallel-stage logits of the query block, before the Markov head.",
        "-", "-", ("self", "hidden_states"),
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM.markov_embed", "call",
        "Markov head: embedding of the previous token.", "-", "-", ("self", "token_ids"),
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM.markov_bias", "call",
        "Markov head: logit bias from that embedding.", "-", "-", ("self", "markov_embed"),
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM.map_draft_to_target", "call",
        "A reduced draft vocabulary's target ids (d2t), once per engine.", "-", "-", ("self", "draft_ids"),
    ),
    Hook(
        "vllm.transformers_utils.configs.speculators.algos.update_dspark", "call",
        "vLLM translates a speculators-layout DSpark config (layouts.py reads the raw one "
        "and checks vLLM's result against it).", "-", "-", ("config_dict", "pre_trained_config"),
        scope="config",
    ),
    Hook(
        "vllm.model_executor.models.qwen3_dspark.DSparkMarkovHead", "call",
        "Its markov_w2 weight: where markov_bias is a plain product with it, the walk adds the "
        "bias to the base logits in one addmm (proposer's _markov_matrix).",
        "markov_bias on that path (called otherwise)", "-", None,
    ),
    Hook(
        "vllm.model_executor.layers.logits_processor.LogitsProcessor", "call",
        "Its scale, soft_cap and logits_as_input say whether markov_bias is that plain product.",
        "-", "-", None,
    ),
    Hook(
        "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod", "call",
        "An unquantized markov_w2 (any other method keeps markov_bias).", "-", "-", None,
    ),
    Hook(
        "vllm.v1.spec_decode.dflash.DFlashProposer.build_per_group_and_layer_attn_metadata", "call",
        "Attention metadata for the query block's forward.", "-", "-", ("self", "cad"),
    ),
    Hook(
        "vllm.v1.spec_decode.dflash.DFlashProposer._determine_batch_execution_and_padding", "call",
        "CUDA-graph mode and padding of the query block's forward.", "-", "-", ("self", "num_tokens"),
    ),
    Hook(
        "vllm.v1.spec_decode.dflash.DFlashProposer._get_slot_mapping", "call",
        "Slot mapping handed to the forward context of the query block.", "-", "-",
        ("self", "num_tokens", "slot_mapping"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_positions", "call",
        "Positions of a skipped step's tokens, queued with its context.", "-", "-",
        ("self", "num_tokens"),
    ),
    Hook(
        "vllm.v1.worker.gpu_input_batch.CachedRequestState", "call",
        "The runner's request states: sampling_params (temperature, max_tokens, "
        "extra_args) and output_token_ids give each request's greediness and verify "
        "cap (dspark_max_verify; the tokens left before max_tokens).", "-", "-",
        ("req_id",),
    ),
    Hook(
        "vllm.v1.core.sched.output.NewRequestData", "call",
        "A new request's block ids and cached tokens: a prefix-cache hit keeps drafter "
        "context only if every cached slot holds it (proposer/drafter_slots.py).", "-", "-",
        ("req_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params", "block_ids",
         "num_computed_tokens"),
    ),
    Hook(
        "vllm.v1.worker.block_table.MultiGroupBlockTable.__getitem__", "call",
        "Group 0's BlockTable: its slot_mapping buffer (.gpu; on CPU read through a NumPy "
        "view) holds the slots the step's target forward wrote, tracked for drafter "
        "context (drafter_slots.py).", "-", "-",
        ("self", "idx"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.input_batch", "call",
        "The runner's input batch, for its block table (prefix caching only).",
        "-", "-", None, scope="runner-state",
    ),
    Hook(
        "vllm.v1.core.sched.output.SchedulerOutput", "call",
        "The step's schedule as the worker sees it: new requests (marked contextless "
        "while the controller is dormant), finished ones, and tokens per request.",
        "-", "-", ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                   "total_num_scheduled_tokens", "scheduled_spec_decode_tokens",
                   "scheduled_encoder_inputs", "finished_req_ids"),
    ),
    Hook(
        "vllm.v1.core.sched.output.CachedRequestData", "call",
        "The running requests' part of the schedule: one resumed from preemption "
        "ends a coasting run (it recomputed without drafter context).",
        "-", "-", ("req_ids", "resumed_req_ids"),
    ),
    Hook(
        "vllm.v1.sample.rejection_sampler.RejectionSampler", "subclass",
        "DSparkRejectionSampler: lossless variable-length verification (greedy and "
        "sampled) with our own per-token sampling parameters, because the stock CPU "
        "expand kernel corrupts per-token temperatures.", "forward (and __init__, which calls super)",
        "vLLM's CPU expand_batch_to_tokens is fixed", ("sampler", "spec_config", "device"),
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.speculative_config", "rebind",
        "Set to None (on the runner only) while the controller is dormant, so those "
        "steps take vLLM's own paths without speculation: no verify or drafter "
        "metadata, no drafter hook. They were most of a dormant step's cost over a "
        "step without speculation.",
        "the runner's spec config, between two steps", _UPSTREAM, None, scope="runner",
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.use_aux_hidden_state_outputs", "rebind",
        "Off with the target's aux layers while dormant (eager targets only): no "
        "step then needs the drafter's features.",
        "the flag, between two steps", _UPSTREAM, None, scope="runner",
    ),
    Hook(
        "vllm.model_executor.models.interfaces.SupportsEagle3.set_aux_hidden_state_layers", "call",
        "Clears the target's aux layers while dormant and sets them back after.",
        "-", "-", ("self", "layers"),
    ),
    Hook(
        "vllm.model_executor.models.interfaces.SupportsEagle3.get_eagle3_default_aux_hidden_state_layers",
        "call", "The target's aux layers when the checkpoint names none (as vLLM's setup).",
        "-", "-", ("self",),
    ),
    Hook(
        "vllm.config.model.ModelConfig.is_hybrid", "call",
        "Dormant steps keep the speculative paths on hybrid targets, whose state "
        "tracking reads the speculative config.", "-", "-", None,
    ),
    Hook(
        "vllm.config.compilation.CUDAGraphMode", "call",
        "Dormant steps run without speculation only where no CUDA graph was captured with it.",
        "-", "-", None,
    ),
    Hook(
        "vllm.config.compilation.CompilationMode", "call",
        "The target's aux outputs are switched off only where it runs eagerly.", "-", "-", None,
    ),
    Hook(
        "vllm.config.vllm.VllmConfig.instance_id", "call",
        "Names the metrics snapshot directory that the worker (which receives the "
        "serving process's config) writes and the serving process's collector reads.",
        "-", "-", None, scope="config",
    ),
    Hook(
        "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p", "call",
        "Top-k/top-p masking applied identically to target and draft distributions.",
        "-", "-", ("logits", "k", "p"),
    ),
)


class VllmHookDrift(RuntimeError):
    """The installed vLLM no longer has what vllm_dspark relies on."""


def _resolve(symbol: str):
    parts = symbol.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(symbol)


def check_hooks(*scopes: str, ledger: tuple[Hook, ...] = LEDGER) -> None:
    problems = []
    for hook in (h for h in ledger if h.scope in scopes):
        try:
            obj = _resolve(hook.symbol)
        except (ImportError, AttributeError) as e:
            problems.append(f"{hook.symbol}: missing ({e})")
            continue
        if hook.params is None:
            continue
        try:  # a class's signature is its constructor's, without self
            names = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            continue
        if names[: len(hook.params)] != hook.params:
            problems.append(f"{hook.symbol}: parameters {names} do not start with {hook.params}")
    if problems:
        raise VllmHookDrift(
            "vllm_dspark does not match the installed vLLM:\n  - " + "\n  - ".join(problems)
            + "\nInstall the pinned vLLM (see vllm_dspark/version.py) or set VLLM_DSPARK_ENABLED=0."
        )


def check_instance(obj, scope: str, ledger: tuple[Hook, ...] = LEDGER) -> None:
    """The instance attributes in ``scope`` (set in constructors, so not
    resolvable on the class) exist on ``obj``."""
    missing = [h.symbol for h in ledger if h.scope == scope and not hasattr(obj, h.symbol.rsplit(".", 1)[1])]
    if missing:
        raise VllmHookDrift("vllm_dspark does not match the installed vLLM: missing " + ", ".join(missing)
                            + ". Install the pinned vLLM (see vllm_dspark/version.py) or set VLLM_DSPARK_ENABLED=0.")


def markdown_table(ledger: tuple[Hook, ...] = LEDGER) -> str:
    """The ledger as the README shows it (`python -m vllm_dspark.compat.ledger`)."""
    rows = ["| vLLM symbol | kind | why | what it replaces | remove when |", "|---|---|---|---|---|"]
    rows += [f"| `{h.symbol}` | {h.kind} | {h.why} | {h.replaces} | {h.remove_when} |" for h in ledger]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
