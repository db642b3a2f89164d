# isthmus — one entry point for people, CI and hooks alike. `make help` lists the targets.
#
# Everything a target needs it installs itself (idempotently): Rust comes from rustup as the
# machine provides it; cargo-fuzz is installed with cargo on first use; Python packages go into
# the project's own venv (.venv).

SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo
QUICK ?=
FUZZ_SECONDS ?= 5
FUZZ_RUNS ?= 10000000
FUZZ_TARGETS := frame handshake ring receive rpc_wire http2_authority hpack grpc_http x509 capi
VENV := .venv
GRPCURL_VERSION := v1.9.3
GRPCURL := .tools/bin/grpcurl
export CARGO_TERM_COLOR ?= never
# The interpreter PyO3 builds against, for maturin and plain cargo alike (no rebuilds between).
export PYO3_PYTHON := $(CURDIR)/$(VENV)/bin/python
# cgo links the Go package against the C ABI's library as cargo built it (debug for tests,
# release for the benchmarks); the rpath lets the binaries find it without LD_LIBRARY_PATH.
CAPI_DIR = $(CURDIR)/target/$(if $(RELEASE),release,debug)
GO_ENV = CGO_LDFLAGS="-L$(CAPI_DIR) -Wl,-rpath,$(CAPI_DIR)"

.PHONY: help test lint fmt unit pytest gotest luatest capi go-bins c-tools lua-tools go-proto fuzz-build-idle fuzz-smoke fuzz-long miri bench demo tools rust-tools peers python clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'
	@echo "  options: QUICK=1 (make bench: reduced set, < 3 min), FUZZ_SECONDS=N (per fuzz target), FUZZ_RUNS=N (make fuzz-long)"

tools: rust-tools peers c-tools lua-tools ## Install what the targets need (idempotent)

# A C compiler: cgo and the C ABI's own test (under AddressSanitizer) need one.
c-tools:
	@command -v cc >/dev/null || { apt-get update -q && apt-get install -y -q gcc; }
	@command -v go >/dev/null || { echo "go not found: install Go (https://go.dev/dl)"; exit 1; }

# Debian's nginx with its Lua module (and resty.core, which it loads), plain LuaJIT (luajit2:
# the luajit package conflicts with the module's libluajit2), lua-cjson and wrk: the Lua
# module's tests and benchmarks.
LUA_PACKAGES := nginx libnginx-mod-http-lua lua-resty-core luajit2 lua-cjson wrk
lua-tools:
	@dpkg -s $(LUA_PACKAGES) >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q $(LUA_PACKAGES); }

# The Rust toolchain's parts: what lint, the fuzz smoke, bench and demo need.
rust-tools:
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }
	@rustup component list --installed 2>/dev/null | grep -q clippy || rustup component add clippy rustfmt
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked

# The real gRPC peers the cross-process tests run: grpcio (Python) and grpcurl.
peers: $(VENV)/.installed $(GRPCURL)

# grpcurl, built from the Go module proxy into .tools/bin.
$(GRPCURL):
	@command -v go >/dev/null || { echo "go not found: grpcurl is built with it"; exit 1; }
	GOBIN=$(CURDIR)/.tools/bin go install github.com/fullstorydev/grpcurl/cmd/grpcurl@$(GRPCURL_VERSION)

# The extension module (crates/isthmus-python) built into the venv, with the package
# (python/isthmus) installed editable. RELEASE=1 builds it optimised for the benchmarks.
python: rust-tools $(VENV)/.installed ## Build the Python package (isthmus + isthmus._native) into .venv
	@mkdir -p target
	@echo "building isthmus._native$(if $(RELEASE), (release)) into $(VENV)"
	@cd python && VIRTUAL_ENV=$(CURDIR)/$(VENV) ../$(VENV)/bin/maturin develop $(if $(RELEASE),--release) \
	  > ../target/maturin.log 2>&1 || { cat ../target/maturin.log; exit 1; }
	@$(VENV)/bin/python -c 'import isthmus._native' || { echo "isthmus._native did not build"; exit 1; }

# The project's Python environment: the extension's build, test and lint tools, and real gRPC
# peers (grpcio) for the tests.
$(VENV)/.installed: python/requirements-dev.txt
	@command -v python3 >/dev/null || { echo "python3 not found"; exit 1; }
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r python/requirements-dev.txt
	@touch $@

test: tools fuzz-build-idle lint unit pytest gotest luatest fuzz-smoke ## Run every check and test: lint, unit, cross-process, doc tests, Python, Go, Lua in nginx, fuzz smoke
	@{ awk '/^test result:/ {p += $$4; f += $$6} END {print p, f}' target/test-output.log; \
	   awk '/^[ ]*--- PASS/ {p++} /^[ ]*--- FAIL/ {f++} END {print p + 0, f + 0}' target/go-test-output.log; \
	   for log in target/pytest-output.log target/luatest-output.log; do \
	     tail -n 1 $$log | awk '{for (i = 2; i <= NF; i++) { if ($$i ~ /^passed/) p = $$(i-1); if ($$i ~ /^failed/) f = $$(i-1) }} END {print p + 0, f + 0}'; \
	   done; \
	 } | awk '{p += $$1; f += $$2} END {printf "tests: %d passed, %d failed\n", p, f}' 

lint: rust-tools python ## cargo fmt --check, one feature set per dependency and unoptimised build-time code, clippy -D warnings, rustdoc -D warnings, ruff, mypy, stubtest
	$(CARGO) fmt --all -- --check
	python3 .ci/unified_features.py
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --quiet
	$(VENV)/bin/ruff check python examples bench lua
	$(VENV)/bin/ruff format --check python examples bench lua
	cd python && ../$(VENV)/bin/mypy isthmus
	cd python && ../$(VENV)/bin/python -m mypy.stubtest isthmus._native
	@test -z "$$(gofmt -l go)" || { echo "gofmt -l go lists unformatted files:"; gofmt -l go; exit 1; }
	@# The C ABI go vet needs, and the sidecar pytest runs, in one build that keeps both cores busy
	@# (the sidecar alone, later, took ~30 s of mostly one core).
	$(CARGO) build --quiet -p isthmus-capi -p gateway-sidecar
	cd go && $(GO_ENV) go vet ./...

fmt: ## Format the Rust code
	$(CARGO) fmt --all

unit: rust-tools peers python go-bins ## cargo test: unit, cross-process integration and doc tests
	@mkdir -p target
	set -o pipefail; $(CARGO) test --workspace 2>&1 | tee target/test-output.log

# The C ABI's library (crates/isthmus-capi), for cgo and the C test.
capi: rust-tools
	$(CARGO) build --quiet -p isthmus-capi $(if $(RELEASE),--release)

# The Go peers the other languages' tests run: go-peer (a Go server) and go-conformance (the Go
# client's checks), into target/go-bin.
go-bins: capi c-tools
	@mkdir -p target/go-bin
	cd go && $(GO_ENV) go build -o ../target/go-bin/ ./cmd/go-peer ./cmd/go-conformance

# The Go and Lua tests name the transport they test: ISTHMUS_UPGRADE=0 keeps their HTTP/2
# channels on HTTP/2 (the upgrade tests there say what they want per channel).
gotest: capi unit ## The Go package's tests (go test), against the Go, Rust and Python peers
	@mkdir -p target
	set -o pipefail; cd go && $(GO_ENV) ISTHMUS_TONIC_PEER=$(CURDIR)/target/debug/tonic-peer ISTHMUS_REQUIRE_PEERS=1 ISTHMUS_UPGRADE=0 \
	  go test -count=1 -v ./... 2>&1 | tee ../target/go-test-output.log | grep -E '^(--- |ok|FAIL|panic)|_test.go'

luatest: capi lua-tools unit go-bins ## The Lua module's tests: a real nginx against the Rust, Go and Python peers
	@mkdir -p target
	set -o pipefail; ISTHMUS_REQUIRE_PEERS=1 ISTHMUS_UPGRADE=0 ISTHMUS_LIB=$(CURDIR)/target/debug/libisthmus_capi.so \
	  ISTHMUS_TONIC_PEER=$(CURDIR)/target/debug/tonic-peer ISTHMUS_GO_PEER=$(CURDIR)/target/go-bin/go-peer \
	  $(VENV)/bin/python -m pytest lua/tests -q -p no:cacheprovider 2>&1 | tee target/luatest-output.log

# Regenerates the Go code of the conformance proto (checked in): protoc from Debian, the
# plugins from the Go module proxy.
go-proto:
	@command -v protoc >/dev/null || { apt-get update -q && apt-get install -y -q protobuf-compiler; }
	GOBIN=$(CURDIR)/.tools/bin go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.11
	GOBIN=$(CURDIR)/.tools/bin go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.1
	PATH=$(CURDIR)/.tools/bin:$$PATH protoc -I tests/proto \
	  --go_out=go/internal/conformancepb --go_opt=paths=source_relative \
	  --go_opt=Mconformance.proto=example.invalid/isthmus/go/internal/conformancepb \
	  --go-grpc_out=go/internal/conformancepb --go-grpc_opt=paths=source_relative \
	  --go-grpc_opt=Mconformance.proto=example.invalid/isthmus/go/internal/conformancepb conformance.proto

# Two pytest workers (pytest-xdist): much of the suite waits (graces, deadlines, connection
# ages), and the waits of one worker overlap the other's work: about half the time on 2 cores.
pytest: python unit ## The Python package's tests (pytest), against the Rust peers unit built
	@mkdir -p target
	$(CARGO) build --quiet -p gateway-sidecar
	set -o pipefail; ISTHMUS_TONIC_PEER=$(CURDIR)/target/debug/tonic-peer ISTHMUS_SIDECAR=$(CURDIR)/target/debug/gateway-sidecar \
	  ISTHMUS_GO_PEER=$(CURDIR)/target/go-bin/go-peer \
	  $(VENV)/bin/python -m pytest python/tests -q -p no:cacheprovider -n 2 2>&1 | tee target/pytest-output.log

# The fuzz targets' build (sanitizers, optimised, its own target directory: about four minutes
# of both cores) shares nothing with the rest. `make test` starts it first, in the background and
# at the idle scheduling class, so that it takes only the CPU the lint, the builds and the tests
# leave (pytest leaves about a core); fuzz-smoke's own build then waits for its lock and finds
# the work done. Its output is in target/fuzz-build.log; if `make test` stops early, it finishes
# on its own.
fuzz-build-idle: rust-tools
	@mkdir -p target
	@cd fuzz && ( RUSTC_BOOTSTRAP=1 $$(command -v chrt >/dev/null && echo chrt --idle 0 || echo nice -n 19) \
	  $(CARGO) fuzz build -O ) > ../target/fuzz-build.log 2>&1 < /dev/null &

# cargo-fuzz drives libFuzzer with AddressSanitizer, which needs unstable flags;
# RUSTC_BOOTSTRAP lets the stable toolchain accept them, so no nightly is needed.
# The targets are built in one cargo invocation first, so that both cores compile and link them;
# then they run two at a time, one per core; one that fails makes xargs, and so this step, fail.
fuzz-smoke: rust-tools ## Run each fuzz target for FUZZ_SECONDS
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz build -O
	cd fuzz && printf '%s\n' $(FUZZ_TARGETS) | RUSTC_BOOTSTRAP=1 xargs -P 2 -I{} bash -c '\
	  $(CARGO) fuzz run -O {} -- -max_total_time=$(FUZZ_SECONDS) 2>&1 \
	    | grep -E "^(Done|==[0-9]+==|SUMMARY|thread .* panicked)|ERROR"; \
	  test $${PIPESTATUS[0]} -eq 0 || { echo "fuzz target {} failed"; exit 1; }'

fuzz-long: rust-tools ## Run each fuzz target for FUZZ_RUNS executions (10 million) and record the counts in docs/fuzz-long.md
	CARGO=$(CARGO) RUNS=$(FUZZ_RUNS) fuzz/long.sh $(FUZZ_TARGETS)

# Miri runs the unsafe code that reads a peer's shared memory (isthmus-shm's ring, frames,
# handshake and copies, and the fuzz targets' decoders over fixed inputs and the local fuzz
# corpus) on a heap segment, and fails on undefined behaviour; what needs a memfd or an mmap
# it cannot run. Slow (minutes), so not in `make test`. Nightly and its miri are installed on
# first use.
MIRI_TESTS := copy:: frame:: handshake:: layout:: ring::
miri: rust-tools ## Run the shared-memory code's unit tests and peer-data decoders under Miri
	@rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^miri' || \
	  rustup toolchain install nightly --profile minimal --component miri,rust-src
	ISTHMUS_STREAMING_COPY_MIN=4096 MIRIFLAGS=-Zmiri-disable-isolation \
	  $(CARGO) +nightly miri test -p isthmus-shm --lib -- $(MIRI_TESTS)
	ISTHMUS_FUZZ_CORPUS=$(CURDIR)/fuzz/corpus MIRIFLAGS=-Zmiri-disable-isolation \
	  $(CARGO) +nightly miri test -p isthmus-shm --test hostile_inputs

bench: rust-tools peers ## Benchmarks beside their competitors: docs/bench/results.json, RESULTS.md, plots, README table
	$(MAKE) --no-print-directory python RELEASE=1
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r python/requirements-bench.txt
	$(CARGO) build --release -p isthmus-bench -p gateway-sidecar
	./target/release/isthmus-bench all $(if $(QUICK),--quick) --out docs/bench/results.json
	./target/release/isthmus-bench soak $(if $(QUICK),--quick) --out docs/bench/results.json
	$(VENV)/bin/python bench/gateway_rounds.py docs/bench/results.json $(if $(QUICK),--quick)
	$(VENV)/bin/python bench/py_raw_bench.py docs/bench/results.json $(if $(QUICK),--quick)
	$(MAKE) --no-print-directory capi RELEASE=1
	cd go && CGO_LDFLAGS="-L$(CURDIR)/target/release -Wl,-rpath,$(CURDIR)/target/release" go build -o ../target/go-bin-release/ ./cmd/go-bench
	./target/go-bin-release/go-bench run $(if $(QUICK),-quick) -out docs/bench/results.json
	$(MAKE) --no-print-directory lua-tools
	$(VENV)/bin/python bench/lua_bench.py docs/bench/results.json $(if $(QUICK),--quick)
	$(VENV)/bin/python bench/report.py docs/bench
	python3 bench/readme_table.py

demo: rust-tools peers ## The gateway ↔ sidecar demo: a Python gateway and a Rust sidecar over isthmus, gRPC over UDS, HTTP/JSON over UDS
	@$(MAKE) --no-print-directory python RELEASE=1
	@echo "building the sidecar (examples/gateway-sidecar)"
	@$(CARGO) build --release --quiet -p gateway-sidecar
	@$(VENV)/bin/python examples/gateway-sidecar/gateway.py --callers 32 --seconds 10

clean: ## Remove build output
	$(CARGO) clean
	rm -rf fuzz/target
