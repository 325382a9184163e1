# Two commands do all the set-up from a fresh clone: `make demo` and `make test`.
# The virtual environment is created on first use. On a machine without an NVIDIA GPU a CPU build of torch is
# pinned, so no multi-GB CUDA wheel is ever downloaded.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test setup bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing torch==$(TORCH_VERSION) (CUDA build)"; \
		$(PIP) install "torch==$(TORCH_VERSION)"; \
	else \
		echo "no GPU: installing the CPU build torch==$(TORCH_VERSION)+cpu"; \
		$(PIP) install "torch==$(TORCH_VERSION)+cpu" || \
		$(PIP) install "torch==$(TORCH_VERSION)+cpu" --extra-index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PIP) install -e ".[test,perf]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/refit_demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis perf/out
