# The README's two commands: `make finetune` and `make test`. Both install whatever is
# missing first (libaio-dev via apt when root, torch 2.13.0, this package editable with
# its extras) and are safe to run again. `make test-fast` is the inner loop: the unit tests
# without the slow ones (no second process, no end-to-end run) and the GPU ones.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
NVME_DIR ?= ./offload-nvme
# The default job: the tiny preset with budgets far below its state, so every tier is used.
FINETUNE_ARGS ?= --preset tiny --steps 50 --device-budget 6M --cpu-budget 8M \
                 --checkpoint-dir ./checkpoints --checkpoint-every 25
PYTEST_ARGS ?=
NATIVE_SOURCES := $(wildcard native/*.c native/*.h) offload/_build_native.py setup.py pyproject.toml

.PHONY: install system-deps torch finetune test test-fast bench clean

install: system-deps torch .install-stamp

# libaio is optional (the I/O layer falls back to threads) but wanted: install it when we can.
system-deps:
	@if [ ! -f /usr/include/libaio.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libaio-dev (apt)"; \
	    (apt-get install -y -qq libaio-dev >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null && apt-get install -y -qq libaio-dev >/dev/null)) || \
	    echo "warning: could not install libaio-dev; building without libaio (thread I/O backend)"; \
	  else \
	    echo "note: libaio-dev is absent and we are not root; building without libaio (thread I/O backend)"; \
	  fi; \
	fi

# torch first, pinned: an unpinned torch pulls several GB of CUDA wheels.
torch:
	@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$(TORCH_VERSION)' else 1)" 2>/dev/null \
	  || $(PIP) install -q "torch==$(TORCH_VERSION)"

# The extras (peft, accelerate, transformers) depend on torch without an upper bound: unconstrained,
# pip "upgrades" the pinned CPU torch to the newest CUDA build. The constraints file holds it.
.install-stamp: $(NATIVE_SOURCES)
	@echo "torch==$$($(PYTHON) -c 'import torch; print(torch.__version__)')" > .torch-constraint.txt
	$(PIP) install -q -c .torch-constraint.txt -e ".[test]"
	@touch $@

# The NVMe directory is made here: the trainer refuses one that does not exist (a mistyped or
# unmounted /mnt/nvme0 must not become a directory on the root disk).
finetune: install
	mkdir -p $(NVME_DIR)
	$(PYTHON) scripts/finetune_100b.py --nvme-path $(NVME_DIR) $(FINETUNE_ARGS)

test: install
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow and not gpu" tests/unit $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info offload/_native*.so offload/_native.c .install-stamp .torch-constraint.txt $(NVME_DIR)
