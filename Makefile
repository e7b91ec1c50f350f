# pagelm: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Pinned: an unpinned torch pulls GBs of CUDA wheels on a CPU machine.
TORCH_VERSION ?= 2.13.0

.PHONY: setup test demo

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[test]"

test: setup
	$(PYTHON) -m pytest -q

demo: setup
	$(PYTHON) -m pagelm.demo
