# isthmus — one entry point for people, CI and hooks alike. `make help` lists the targets.
#
# Everything a target needs it installs itself (idempotently): Rust comes from rustup as the
# machine provides it; cargo-fuzz is installed with cargo on first use; Python packages go into
# the project's own venv (.venv).

SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo
QUICK ?=
FUZZ_SECONDS ?= 15
FUZZ_TARGETS := frame handshake ring rpc_wire http2_authority grpc_http
VENV := .venv
GRPCURL_VERSION := v1.9.3
GRPCURL := .tools/bin/grpcurl
export CARGO_TERM_COLOR ?= never

.PHONY: help test lint fmt unit fuzz-smoke bench demo tools rust-tools peers clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'
	@echo "  options: QUICK=1 (make bench: reduced set, < 2 min), FUZZ_SECONDS=N (per fuzz target)"

tools: rust-tools peers ## Install what the targets need (idempotent)

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

# The project's Python environment: real gRPC peers (grpcio) for the tests.
$(VENV)/.installed: python/requirements-dev.txt
	@command -v python3 >/dev/null || { echo "python3 not found"; exit 1; }
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r python/requirements-dev.txt
	@touch $@

test: tools lint unit fuzz-smoke ## Run every check and test: lint, unit, cross-process, doc tests, fuzz smoke
	@awk '/^test result:/ {p += $$4; f += $$6} END {printf "tests: %d passed, %d failed\n", p, f}' target/test-output.log

lint: rust-tools ## cargo fmt --check, clippy -D warnings, rustdoc -D warnings
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --quiet

fmt: ## Format the Rust code
	$(CARGO) fmt --all

unit: rust-tools peers ## cargo test: unit, cross-process integration and doc tests
	@mkdir -p target
	set -o pipefail; $(CARGO) test --workspace 2>&1 | tee target/test-output.log

# cargo-fuzz drives libFuzzer with AddressSanitizer, which needs unstable flags;
# RUSTC_BOOTSTRAP lets the stable toolchain accept them, so no nightly is needed.
fuzz-smoke: rust-tools ## Run each fuzz target for FUZZ_SECONDS
	cd fuzz && for t in $(FUZZ_TARGETS); do \
	  RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run -O $$t -- -max_total_time=$(FUZZ_SECONDS) 2>&1 \
	    | grep -E '^(Done|==[0-9]+==|SUMMARY|thread .* panicked)|ERROR' ; \
	  test $${PIPESTATUS[0]} -eq 0 || exit 1; \
	done

bench: rust-tools ## Benchmarks beside their competitors; writes docs/bench/results.json
	$(CARGO) build --release -p isthmus-bench
	./target/release/isthmus-bench all $(if $(QUICK),--quick) --out docs/bench/results.json
	python3 bench/readme_table.py

demo: rust-tools ## The demo: a Rust client and server on shm:// beside tonic over a Unix socket
	$(CARGO) build --release -p isthmus-bench
	./target/release/isthmus-bench demo

clean: ## Remove build output
	$(CARGO) clean
	rm -rf fuzz/target
