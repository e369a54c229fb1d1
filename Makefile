# mcguard — build, test, demo, bench, install, clean.
# `make demo` and `make test` do all set-up on a fresh Debian/Ubuntu machine
# with Go and Python: system packages (apt, when root), Go modules, and the
# Python tools in build/venv (never the system's Python).

PYTHON   ?= python3
GO       ?= go
PREFIX   ?= /usr/local
LIB      := build/libmcguard.so
# The Python that runs the tests, the demo and the benchmarks: PYTHON's
# virtual environment with pytest and prometheus-client (deps-python).
TOOLS_VENV := build/venv
PY         := $(TOOLS_VENV)/bin/python
# Mooncake's own wheel (TCP, no CUDA), the peer the API parity test runs.
MOONCAKE_VENV    := build/venv-mooncake
MOONCAKE_VERSION := 0.3.13.post1
# NIXL for bench-peer: its CUDA 12 build without its dependencies (its meta
# package pulls in torch; the UCX backend on host memory needs only numpy).
NIXL_WHEEL := nixl-cu12==1.5.1
CUDA_MODEL := build/libcudamodel.so
# mc_guard_transfer without ctypes, built beside the Python sources (the
# wheel builds it too); where Python's headers are missing, ctypes serves.
PY_EXT_SUFFIX := $(shell python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX") or ".so")')
PY_INCLUDE    := $(shell python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
FASTCALL      := python/mcguard/_fastcall$(PY_EXT_SUFFIX)
NIC_MODEL  := build/libnicmodel.so
APT_PKGS := pkg-config libzmq3-dev libibverbs-dev cmake g++ make libgtest-dev
GO_SRC   := $(shell find core verify export -name '*.go' -o -name '*.c' -o -name '*.h' -o -name '*.map' 2>/dev/null) include/mcguard.h go.mod go.sum
CTEST_DIR := build/cmake

export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))
# The software models the tests run the real loaders on: built once by
# `make build`, found by Go and Python through these two variables.
export MCGUARD_CUDA_MODEL := $(CURDIR)/$(CUDA_MODEL)
export MCGUARD_NIC_MODEL  := $(CURDIR)/$(NIC_MODEL)

.PHONY: device-check test-vllm test-sglang all build deps deps-system deps-go deps-python venv-support test test-go test-python test-c demo bench fuzz soak endurance install clean mooncake-venv nixl-venv bench-peer bench-read perf-report

FUZZTIME ?= 30s
FUZZ_WIRE := FuzzDecodeHeader FuzzDecodeRanges FuzzDecodeNotice
FUZZ_CORE := FuzzControlRequest FuzzLoadConfig

all: build

## deps: install what the build and tests need
deps: deps-system deps-go deps-python

deps-system:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    (apt-get install -y --no-install-recommends $$missing || (apt-get update && apt-get install -y --no-install-recommends $$missing)) >/dev/null; \
	  else \
	    echo "missing system packages:$$missing"; \
	    echo "run: sudo apt-get install -y$$missing"; exit 1; \
	  fi; \
	fi

deps-go:
	@$(GO) mod download

# The Python tools the tests need go into build/venv, never the system's
# Python: it sees the system's packages and adds only what is missing.
deps-python: $(TOOLS_VENV)/.installed
$(TOOLS_VENV)/.installed: | venv-support
	$(PYTHON) -m venv --system-site-packages $(TOOLS_VENV)
	@$(PY) -c "import pytest" 2>/dev/null || $(PY) -m pip install -q pytest
	@$(PY) -c "import prometheus_client" 2>/dev/null || $(PY) -m pip install -q prometheus-client
	touch $@

# Debian's own python3 makes virtual environments only with python3-venv.
venv-support:
	@$(PYTHON) -c "import ensurepip" 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then echo "installing: python3-venv"; \
	    (apt-get install -y --no-install-recommends python3-venv || (apt-get update && apt-get install -y --no-install-recommends python3-venv)) >/dev/null; \
	  else echo "$(PYTHON) cannot make a virtual environment; run: sudo apt-get install -y python3-venv"; exit 1; fi; }

## mooncake-venv: Mooncake's wheel in build/venv-mooncake, for the test that
## runs one script on Mooncake and on GuardedTransferEngine
mooncake-venv: $(MOONCAKE_VENV)/.installed
$(MOONCAKE_VENV)/.installed: | venv-support
	$(PYTHON) -m venv $(MOONCAKE_VENV)
	$(MOONCAKE_VENV)/bin/pip install -q mooncake-transfer-engine-non-cuda==$(MOONCAKE_VERSION)
	touch $@

## nixl-venv: NIXL's UCX backend in build/venv-mooncake too, for bench-peer and the verified-pull tests
nixl-venv: $(MOONCAKE_VENV)/.nixl-installed
$(MOONCAKE_VENV)/.nixl-installed: $(MOONCAKE_VENV)/.installed
	$(MOONCAKE_VENV)/bin/pip install -q --no-deps $(NIXL_WHEEL) numpy
	touch $@

## bench-peer: the performance goals, mcguard beside Mooncake's TCP
## transport and NIXL over UCX (UCX_TLS=tcp), on one host and over
## sockets, and over Mooncake's engine beside Mooncake alone: two processes
## each, rounds interleaved, SHA-1 checked; a table of every goal, met or
## not, and its JSON in build/perf/goals.json (BENCH_PEER_ARGS for others)
BENCH_PEER_ARGS ?= --goals --json build/perf/goals.json
bench-peer: build mooncake-venv nixl-venv
	PYTHONPATH=$(CURDIR)/python $(MOONCAKE_VENV)/bin/python -m mcguard.tools.peerbench $(BENCH_PEER_ARGS)

## bench-read: verified reads beside unverified ones: NIXL's READ alone and
## checked by GuardedNixlAgent (tail, digest), mcguard's read and sealed
## read over sockets and on one host, two processes, one run, ratios
BENCH_READ_ARGS ?= --rounds 10
bench-read: build mooncake-venv nixl-venv
	PYTHONPATH=$(CURDIR)/python $(MOONCAKE_VENV)/bin/python -m mcguard.tools.readbench $(BENCH_READ_ARGS)

## perf-report: the performance page's figures: bench-peer beside Mooncake
## and NIXL (same host and sockets), then over Mooncake's engine with
## consecutive and with scattered blocks, each run's
## JSON in build/perf; scripts/perf_report.py draws docs/perf/*.png and
## rewrites the page's tables (matplotlib, in build/venv)
PERF_ROUNDS ?= 3
PERF_ENGINES ?= mooncake nixl socket mcguard-off mcguard-tail mcguard-digest mcguard-socket-off mcguard-socket-tail mcguard-socket-digest
perf-report: build mooncake-venv nixl-venv deps-python
	PYTHONPATH=$(CURDIR)/python $(MOONCAKE_VENV)/bin/python -m mcguard.tools.peerbench --rounds $(PERF_ROUNDS) --engines $(PERF_ENGINES) --json build/perf/peer.json
	PYTHONPATH=$(CURDIR)/python $(MOONCAKE_VENV)/bin/python -m mcguard.tools.peerbench --rounds $(PERF_ROUNDS) --over-mooncake --json build/perf/over-mooncake.json
	PYTHONPATH=$(CURDIR)/python $(MOONCAKE_VENV)/bin/python -m mcguard.tools.peerbench --rounds $(PERF_ROUNDS) --over-mooncake --layout scattered --json build/perf/over-mooncake-scattered.json
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) scripts/perf_report.py build/perf/peer.json build/perf/over-mooncake.json build/perf/over-mooncake-scattered.json

## build: build/libmcguard.so and its cgo-generated header build/libmcguard.h,
## the software models of the CUDA driver and of an RDMA NIC the tests use,
## and python/mcguard/_fastcall (mc_guard_transfer and mc_guard_sync_transfers without ctypes)
build: $(LIB) $(CUDA_MODEL) $(NIC_MODEL) $(FASTCALL)

$(FASTCALL): python/mcguard/_fastcall.c include/mcguard.h
	@if [ -f "$(PY_INCLUDE)/Python.h" ]; then \
	  echo "cc -O2 -shared -fPIC -o $@ python/mcguard/_fastcall.c"; \
	  cc -O2 -Wall -Wextra -shared -fPIC -Iinclude -I"$(PY_INCLUDE)" -o $@ python/mcguard/_fastcall.c; \
	else echo "note: no Python.h under $(PY_INCLUDE): mcguard's Python calls go through ctypes alone"; fi

$(NIC_MODEL): tests/nicmodel/nicmodel.c core/transport/rdma/verbs/flush_abi.h | deps-system
	cc -shared -fPIC -O2 -Wall -o $@ $< -lpthread -ldl

$(CUDA_MODEL): tests/cudamodel/cudamodel.c
	cc -shared -fPIC -O2 -Wall -o $@ $< -lpthread

# Go's build cache does not see include/mcguard.h (outside export/, which
# includes it) change, and would link the C shims compiled against the old
# one (its version string, say): the header's checksum in the C flags
# makes a changed header recompile them.
HEADER_SUM = $(shell sha1sum include/mcguard.h | cut -c1-12)

$(LIB): $(GO_SRC) | deps-system deps-go
	CGO_CFLAGS="$${CGO_CFLAGS:--O2 -g} -DMCG_HEADER_SUM=$(HEADER_SUM)" $(GO) build -buildmode=c-shared -o $(LIB) \
	  -ldflags "-extldflags=-Wl,--version-script=$(CURDIR)/export/mcguard.map,-soname,libmcguard.so" ./export

## test: Go (race detector), C/C++ (ctest), Python (pytest)
# Every suite runs, whichever fails first; the summary names those that
# failed.
TEST_SUITES := test-go test-c test-python
test: deps build
	@failed=""; for t in $(TEST_SUITES); do $(MAKE) --no-print-directory $$t || failed="$$failed $$t"; done; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed" >&2; exit 1; fi; \
	echo "make test: $(TEST_SUITES): all passed"

# The tests that skip under the race detector (it allocates and grows RSS
# for its own bookkeeping), run again without it: every one of them.
NORACE_TESTS := TestSoak|TestEndurance|TestSmallTransferAllocatesNothing|TestBatchedTransferAllocatesNothing|TestLandingAllocatesLittlePerDescriptor|TestControlFloodIsBounded|TestHonestSessionsGetInDuringAHelloFlood

test-go: $(CUDA_MODEL) $(NIC_MODEL)
	$(GO) vet -unsafeptr=false ./...
	$(GO) test -race -count=1 ./...
	MCG_FLOOD_SECONDS=60 $(GO) test -count=1 -run '^($(NORACE_TESTS))$$' -v ./core/

## endurance: one receiver through 10^5 handshakes from churning senders,
## descriptor exhaustion, control floods and stalled peers, while long-lived
## digest and tail sessions transfer (make test runs 3000 handshakes)
ENDURANCE_HANDSHAKES ?= 100000
endurance: deps-system deps-go $(CUDA_MODEL) $(NIC_MODEL)
	MCGUARD_ENDURANCE_HANDSHAKES=$(ENDURANCE_HANDSHAKES) $(GO) test -count=1 -timeout 2h -run '^TestEndurance$$' -v ./core/

## soak: the leak soak alone (10^4 cycles; MCGUARD_SOAK_CYCLES to change)
soak: deps-system deps-go $(CUDA_MODEL) $(NIC_MODEL)
	$(GO) test -count=1 -run '^TestSoak$$' -v ./core/

test-c: $(LIB)
	cmake -S . -B $(CTEST_DIR) -DMCGUARD_LIBRARY=$(CURDIR)/$(LIB) >/dev/null
	cmake --build $(CTEST_DIR)
	cd $(CTEST_DIR) && ctest --output-on-failure

test-python: $(LIB) $(CUDA_MODEL) $(NIC_MODEL) deps-python mooncake-venv nixl-venv
	$(PY) -m pytest -q -rs python/tests

## demo: the PD stress on loopback with injected lag, verify=off beside verify=tail
demo: build deps-python
	$(PY) -m mcguard.tools.demo

## bench: guarded vs unguarded vs a raw socket pair (Go), one vs four queue pairs on the NIC model, small-transfer latency through the C ABI (same host and socket, two processes), and the stress's off vs tail (Python)
bench: build deps-python
	cmake -S . -B $(CTEST_DIR) -DMCGUARD_LIBRARY=$(CURDIR)/$(LIB) >/dev/null
	cmake --build $(CTEST_DIR) --target latency
	$(CTEST_DIR)/latency 20000
	$(GO) test -run '^$$' -bench SmallTransfer -benchtime 20000x -count 3 ./core/
	$(GO) test -run '^$$' -bench Modes -benchtime 3s -count 5 ./core/
	$(GO) test -run '^$$' -bench RDMAModelStripes -benchtime 20x -count 5 ./core/
	$(GO) test -run '^$$' -bench Quiesce -benchtime 1x -count 3 ./core/
	$(PY) -m mcguard.tools.bench --rounds 5 --seconds 4

## test-vllm: prefill and decode through vLLM's own MooncakeConnector worker
## (python/tests/test_vllm_pd.py) and its NixlConnector's reads
## (test_vllm_nixl.py), in a virtual environment with the pinned vLLM,
## Mooncake wheel and NIXL (the meta package and its CUDA 13 build, as
## vLLM's torch is) kept in $(MCGUARD_CACHE) (made once: about 5 minutes
## and 10 GB; reused after)
VLLM_VERSION  ?= 0.33.0
VLLM_NIXL     := nixl==1.5.1 nixl-cu13==1.5.1
MCGUARD_CACHE ?= $(HOME)/.cache/mcguard
test-vllm: $(LIB)
	@py=$$(MCGUARD_CACHE=$(MCGUARD_CACHE) scripts/framework-venv.sh vllm $(VLLM_VERSION) $(MOONCAKE_VERSION) $(VLLM_NIXL)) && \
	  MCGUARD_REQUIRE_VLLM=1 $$py -m pytest -s -v -p no:cacheprovider python/tests/test_vllm_pd.py python/tests/test_vllm_nixl.py \
	    python/tests/test_vllm_plugin.py

## test-sglang: prefill and decode through SGLang's own Mooncake KV manager
## (python/tests/test_sglang_pd.py), in a virtual environment with the
## pinned SGLang and Mooncake wheel kept in $(MCGUARD_CACHE) (made once:
## about 3 minutes and 11 GB; reused after)
SGLANG_VERSION ?= 0.5.23
test-sglang: $(LIB)
	@py=$$(MCGUARD_CACHE=$(MCGUARD_CACHE) scripts/framework-venv.sh sglang $(SGLANG_VERSION) $(MOONCAKE_VERSION)) && \
	  MCGUARD_REQUIRE_SGLANG=1 $$py -m pytest -s -v -p no:cacheprovider python/tests/test_sglang_pd.py python/tests/test_sglang_plugin.py

## device-check: the GPU check (an NVIDIA machine with PyTorch; see scripts/device-check.sh)
DEVICE_CHECK_ARGS ?=
device-check: build
	scripts/device-check.sh $(DEVICE_CHECK_ARGS)

## fuzz: each decoder's fuzz target for FUZZTIME (the seed corpora run in every `go test`)
fuzz: deps-system deps-go $(CUDA_MODEL) $(NIC_MODEL)
	@for t in $(FUZZ_WIRE); do echo "== $$t"; $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) ./core/wire || exit 1; done
	@for t in $(FUZZ_CORE); do echo "== $$t"; $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) ./core || exit 1; done

install: build
	cmake -S . -B build/install-tree -DMCGUARD_LIBRARY=$(CURDIR)/$(LIB) -DCMAKE_INSTALL_PREFIX=$(PREFIX) >/dev/null
	cmake --install build/install-tree

clean:
	rm -rf $(LIB) build/libmcguard.h $(CUDA_MODEL) $(NIC_MODEL) $(CTEST_DIR) build/install-tree $(FASTCALL)
	rm -rf build/lib.* build/bdist.* python/mcguard.egg-info
	find python -name __pycache__ -type d -exec rm -rf {} +
