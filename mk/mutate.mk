# Mutation testing (issue 40), included by the Makefile: `include mk/mutate.mk`.
#
# Not part of `make test`: it runs the narrowed unit tests of each module once
# per mutant (minutes per module on 2 cores). scripts/mutate says how; the
# recorded score, the modules covered and every explained survivor are in
# docs/mutation.md.
#
#   make mutate                       every module of scripts/mutate's MODULES
#   make mutate MUTATE="identity.py"  some of them (paths under service/weightcache)
#
# Uses $(VPY) and $(STAMP_VENV) from the Makefile: mutmut is installed into .venv.

MUTMUT_VERSION := 3.8.1
STAMP_MUTMUT   := $(VENV)/.mutmut-$(MUTMUT_VERSION).stamp
MUTATE         ?=

.PHONY: mutate

$(STAMP_MUTMUT): $(STAMP_VENV) mk/mutate.mk
	$(VPY) -m pip install -q mutmut==$(MUTMUT_VERSION)
	@touch $@

mutate: $(STAMP_MUTMUT)
	PYTHON=$(abspath $(VPY)) scripts/mutate $(MUTATE)
