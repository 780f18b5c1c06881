# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_dp_installed

.PHONY: setup test demo lint bench clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned to the CPU build that lies on disk; an open range would pull a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev,examples]"
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check hf_dp tests examples benchmarks

test: setup lint
	$(VENV)/bin/pytest -q -x tests

demo: setup
	$(PY) examples/demo.py --output_dir demo_output

bench: setup
	$(PY) benchmarks/step_time.py

clean:
	rm -rf $(VENV) demo_output .pytest_cache
