# mcpgw: two commands for a fresh machine with Rust: `make run` and `make test`.
CARGO ?= cargo
JOBS ?= 2
export CARGO_BUILD_JOBS := $(JOBS)

.PHONY: run test deps build build-release bench fmt clippy clean compose-up compose-down compose-test nemesis

deps:
	@scripts/deps.sh

build:
	$(CARGO) build -j$(JOBS) --workspace --bins

build-release:
	$(CARGO) build -j$(JOBS) --release --workspace --bins

## Start a local fleet: Redis, the demo upstream, mesh certificates, 4 workers.
run: deps build-release
	@scripts/run.sh

## Every test: unit, property, and integration tests against real processes.
test: deps build
	@JOBS=$(JOBS) scripts/test.sh

## Every forwarding configuration side by side (direct, sticky, QUIC, TCP, the
## same-host path, Redis pub/sub, round-robin, and a virtual server of three members
## local and forwarded) at several concurrency levels, plus idle-session memory,
## then an open-loop sweep of the transports at fixed offered rates (each stops at its
## saturation rate, then two runs narrow it down) and a run of each at half the Redis
## baseline's saturation rate: about 6 minutes on 2 cores.
## Pass options with BENCH_ARGS="--duration 10s ...".
## Then the scale scenario: 4 workers, 10,000 sessions holding GET streams, a
## round-robin tools/call load on top (about 30 s; options in SCALE_ARGS).
bench: deps build-release
	$(CARGO) run -j$(JOBS) --quiet --release -p mcpgw-perf --bin mcpgw-bench -- compare --rates 1000,2000,4000,8000,16000,32000 $(BENCH_ARGS)
	$(CARGO) run -j$(JOBS) --quiet --release -p mcpgw-perf --bin mcpgw-bench -- scale --duration 5s $(SCALE_ARGS)

## The container fleet (compose/): Redis, the demo upstream, 3 gateway containers with
## 2 workers each, nginx round-robin in front. Builds the image from compose/Dockerfile
## (needs an image registry; MCPGW_HOST_BINARIES=1 builds without one). Prints the URL.
compose-up:
	@scripts/compose-up.sh

compose-down:
	@scripts/compose-down.sh

## The container fleet under faults (kill, pause, network cut, certificate rotation),
## end to end through nginx with the Python SDK. Works without an image registry:
## base images are made locally when missing; binaries come from target/debug.
compose-test: deps build
	@scripts/compose-test.sh

## The container fleet under a seeded random schedule of faults (worker kill -9,
## container kill, pauses below and above the lease, network cuts; at most two at
## once), clients that record every request, and a checker of the whole history
## (docs/compose.md, "make nemesis"). NEMESIS_SECONDS (300), NEMESIS_SEED (random,
## printed first: the same seed repeats the schedule), NEMESIS_FAULTS (a cap).
nemesis: deps build
	@scripts/nemesis.sh

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy -j$(JOBS) --workspace --all-targets -- -D warnings

clean:
	$(CARGO) clean
	rm -rf build
