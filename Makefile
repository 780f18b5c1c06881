# Two commands on a fresh machine: `make demo` and `make test`.
#
# TORCH: the torch installed into the venv before everything else. The default is the CPU build pinned below (what
#   CI runs); an open range would pull a multi-GB CUDA build. TORCH=<requirement> installs another one
#   (e.g. TORCH=torch==2.6.0). TORCH=skip installs none and keeps the torch already importable from the venv (a CUDA
#   wheel you installed into it, or the system's with VENV_FLAGS=--system-site-packages); pip is then pinned to that
#   exact version, so no dependency can replace it. A choice other than the default is remembered in the venv, so a
#   later plain `make test` (e.g. after pyproject.toml changed) does not put the CPU build over it; `make clean` resets.
# VENV_FLAGS: extra flags for `python3 -m venv` when the venv is created, e.g. --system-site-packages.
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_dp_installed
TORCH_PIN := torch==2.13.0
TORCH_CHOICE := $(VENV)/.hf_dp_torch
TORCH ?= $(or $(shell cat $(TORCH_CHOICE) 2>/dev/null),$(TORCH_PIN))

.PHONY: setup test demo audit lint bench clean

$(PY):
	python3 -m venv $(if $(VENV_FLAGS),$(VENV_FLAGS) )$(VENV)

$(STAMP): $(PY) pyproject.toml
ifeq ($(TORCH),skip)
	@$(PY) -c "import torch" 2>/dev/null || { echo "TORCH=skip, but $(PY) cannot import torch. Install your build \
	first (e.g. $(PY) -m pip install torch --index-url https://download.pytorch.org/whl/cu126), or create the venv \
	with VENV_FLAGS=--system-site-packages, or drop TORCH=skip for the pinned CPU build." >&2; exit 1; }
	$(PY) -m pip install -e ".[dev,examples]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
else
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev,examples]"
endif
ifneq ($(TORCH),$(TORCH_PIN))
	echo "$(TORCH)" > $(TORCH_CHOICE)
endif
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check hf_dp tests examples benchmarks

test: setup lint
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -x tests

# HF_HUB_OFFLINE: the demo, audit and benchmark defaults build everything locally; offline, nothing (bitsandbytes'
# kernel lookup at import, through peft, included) reaches the Hub.
demo: setup
	HF_HUB_OFFLINE=1 $(PY) examples/demo.py --output_dir demo_output

audit: setup
	HF_HUB_OFFLINE=1 $(PY) examples/audit.py --output_dir audit_output

bench: setup
	HF_HUB_OFFLINE=1 $(PY) benchmarks/step_time.py

clean:
	rm -rf $(VENV) demo_output audit_output .pytest_cache
