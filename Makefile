# weightcache: `make demo` runs the main job, `make test` the whole suite.
# Both set up what they need on a fresh Debian 12 machine (root): apt
# packages, then a venv in .venv with torch 2.13.0, the CPU build (README.md
# lists what a fresh machine needs first: git, make, python3, ca-certificates).

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
# libnuma1: vLLM's CPU extension (vllm._C) links it; without it every engine test
# failed ('_C' object has no attribute 'init_cpu_memory_env'). prometheus: promtool
# and the tests' Prometheus servers (its own service is disabled: see below).
# openssl: the certificates of the metrics endpoint's TLS tests.
APT_PKGS := libsystemd-dev pkg-config systemd-container debootstrap \
            dpkg-dev debhelper dh-python pybuild-plugin-pyproject python3-all \
            python3-setuptools lintian rpm fakeroot build-essential \
            python3-venv python3-dev cpio prometheus libnuma1 openssl
# torch: the CPU build, 2.13.0+cpu, from PyTorch's CPU wheel index, as
# weightcache-setup-runtime does; PyPI's torch==2.13.0 is the CUDA build (18
# nvidia-* wheels, a 4.7 GB .venv). A wheel directory pip is configured with
# (find-links in pip.conf or PIP_FIND_LINKS, as on CI) is honoured: when it
# holds the wheel, the CPU index is not asked at all.
TORCH_PIN       := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# $(call torch_install,PYTHON): one recipe line (a shell test, not $(shell): make
# expands a recipe before the venv it names exists).
torch_install = if $(1) -m pip install -q --dry-run --no-index --no-deps '$(TORCH_PIN)' >/dev/null 2>&1; then \
                  echo "torch: $(TORCH_PIN) from the wheel directory pip is configured with"; \
                  $(1) -m pip install -q '$(TORCH_PIN)'; \
                else \
                  echo "torch: $(TORCH_PIN) from $(TORCH_CPU_INDEX)"; \
                  $(1) -m pip install -q '$(TORCH_PIN)' --extra-index-url $(TORCH_CPU_INDEX); \
                fi
STAMP_APT  := .cache/apt.stamp
STAMP_VENV := $(VENV)/.stamp

include mk/vllm.mk
include mk/mutate.mk

.PHONY: all setup demo test test-fast gpu-check bench clean
all: test

$(STAMP_APT): Makefile
	@mkdir -p .cache
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing $$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null || exit 1; \
	  case " $$missing " in *" prometheus "*) \
	    echo "apt: prometheus is for promtool and the tests' own servers: its Debian service (a server on *:9090, started at boot) is disabled and stopped"; \
	    systemctl disable --now prometheus.service >/dev/null 2>&1 || true;; \
	  esac; \
	fi
	@touch $@

$(STAMP_VENV): pyproject.toml $(STAMP_APT)
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	@$(call torch_install,$(VPY))
	$(VPY) -m pip install -q -e '.[test,systemd,seeding]'
	@touch $@

setup: $(STAMP_VENV)

demo: setup
	$(VPY) examples/demo.py

# Everything, the slow system tests included: containers, packages, vLLM (CPU), the vLLM 0.33/0.34 surface check.
# Both stages always run; the target fails at the end if either failed.
test: setup setup-vllm vllm-wheels
	@rc=0; \
	$(VPY) -m pytest -q tests || rc=1; \
	$(VLLM_PY) -m pytest -q tests/engines || rc=1; \
	exit $$rc

test-fast: setup
	$(VPY) -m pytest -q tests/unit tests/integration

# Runs on a GPU machine from the source tree (no install): see scripts/gpu-check.
gpu-check:
	scripts/gpu-check

clean: clean-vllm
	rm -rf $(VENV) .cache build dist service/*.egg-info
