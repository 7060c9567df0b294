# Two set-up commands for a fresh machine (README.md):
#   make run    install everything and run the main job on configs/tiny.yaml
#   make test   install what the tests need and run them
# Both use the current python3 (no virtual environment is created).

PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# Installed before the package: a bare `torch` requirement would pull a multi-GB CUDA build on a
# CPU machine. Override for another build, e.g. `make run TORCH_SPEC='torch==2.11.0'`.
TORCH_SPEC ?= torch==2.13.0
RUN_CONFIG ?= configs/tiny.yaml
RUN_OUTPUT ?= results/
PYTEST_ARGS ?=

# Environment for every process started from here (GPU workers, Ray, tests): NVLink multicast
# (NVLS) stays off, and Ray runs with token authentication (the embedded Ray of `make run` makes the
# token in ~/.ray/auth_token if there is none; the tests make their own: tests/conftest.py).
export NVSHMEM_DISABLE_NVLS ?= 1
export NCCL_NVLS_ENABLE ?= 0
export TORCH_SYMM_MEM_DISABLE_MULTICAST ?= 1
export RAY_AUTH_MODE ?= token

.PHONY: run test

# `make run` keeps an already importable torch (a GPU machine's CUDA build) and takes the GPU
# extras only where nvidia-smi answers.
run:
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "keeping installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PIP) install "$(TORCH_SPEC)"; \
	fi
	@if nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing flashdmoe with the gpu extras"; \
		$(PIP) install -e '.[gpu]'; \
	else \
		echo "no GPU (nvidia-smi failed): installing flashdmoe for CPU"; \
		$(PIP) install -e .; \
	fi
	$(PYTHON) -m flashdmoe run --config $(RUN_CONFIG) --output $(RUN_OUTPUT)

# pytest's own exit status is kept: "no tests collected" (5) fails the target like a failing test.
test:
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e '.[test]'
	$(PYTHON) -m pytest $(PYTEST_ARGS)
