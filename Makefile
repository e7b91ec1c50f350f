# pagelm: `make serve` sets up and runs the main job (an OpenAI-compatible server on the
# built-in demo model); `make test` sets up and runs the tests; `make demo` runs LLM.generate.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Pinned: an unpinned torch pulls GBs of CUDA wheels on a CPU machine.
TORCH_VERSION ?= 2.13.0

.PHONY: setup test demo serve

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[test]"

test: setup
	$(PYTHON) -m pytest -q

demo: setup
	$(PYTHON) -m pagelm.plugins.demo

serve: setup
	$(PYTHON) -m pip install -q -e ".[server]"
	$(PYTHON) -c "import sys; from pagelm.cli import main; sys.exit(main(['serve']))"
