"""Loggers that go through vLLM's logging setup (format, level, VLLM_LOGGING_*).

vLLM configures the "vllm" logger tree only, so ours hang below it."""


def get_logger(module: str):
    from vllm.logger import init_logger

    return init_logger("vllm.dspark." + module.removeprefix("vllm_dspark."))
