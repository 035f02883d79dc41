# weightcache: `make demo` runs the main job, `make test` the whole suite.
# Both set up what they need on a fresh Debian 12 machine (root): apt
# packages, then a venv in .venv with torch==2.13.0 (CPU build from local disk).

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
APT_PKGS := libsystemd-dev pkg-config systemd-container debootstrap \
            dpkg-dev debhelper dh-python pybuild-plugin-pyproject python3-all \
            python3-setuptools lintian rpm fakeroot build-essential \
            python3-venv python3-dev cpio prometheus
STAMP_APT  := .cache/apt.stamp
STAMP_VENV := $(VENV)/.stamp

include mk/vllm.mk

.PHONY: all setup demo test test-fast gpu-check bench clean
all: test

$(STAMP_APT): Makefile
	@mkdir -p .cache
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing $$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null; \
	fi
	@touch $@

$(STAMP_VENV): pyproject.toml $(STAMP_APT)
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,systemd]'
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
