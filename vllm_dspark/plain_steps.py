"""PlainStepSwitch: run a step as vLLM runs it without speculation.

While the controller is dormant no step drafts, and vLLM's speculative paths
(verify metadata, the drafter's attention metadata and hook, the target's aux
hidden states) were most of what a dormant step cost over a step without
speculation. This is the only code that rebinds attributes of vLLM's live
runner (the ledger's "runner" scope, checked when the switch is built). Not
for hybrid targets (their state tracking reads the speculative config) nor
with CUDA graphs (captured with it); the target's aux outputs go too only
where it runs eagerly (a compiled forward keeps the outputs it was traced with).
"""

from vllm.config.compilation import CompilationMode, CUDAGraphMode

from vllm_dspark.compat.ledger import check_instance


class PlainStepSwitch:
    def __init__(self, runner, vllm_config):
        check_instance(runner, "runner")
        compilation = vllm_config.compilation_config
        self.allowed = (not vllm_config.model_config.is_hybrid
                        and compilation.cudagraph_mode == CUDAGraphMode.NONE)
        self._aux = compilation.mode == CompilationMode.NONE
        self._runner = runner
        self._spec_config = runner.speculative_config
        self.on = False

    def set(self, on: bool) -> None:
        """The coming steps run without speculation (on), or with it again."""
        if on == self.on:
            return
        self.on = on
        runner = self._runner
        runner.speculative_config = None if on else self._spec_config
        if self._aux:
            runner.use_aux_hidden_state_outputs = not on
            layers = () if on else (runner._get_eagle3_aux_layers_from_config()
                                    or runner.model.get_eagle3_default_aux_hidden_state_layers())
            runner.model.set_aux_hidden_state_layers(layers)
