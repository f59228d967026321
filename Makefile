# The README's two commands: `make run` and `make test`. Both install what is missing first.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
CMAKE_FLAGS ?=
CTEST_FLAGS ?=
STRESS_REPEAT ?= 20

# Fuzzing (docs/fuzzing.md): clang and libFuzzer in a build directory of its own. Not part of `make
# test`, which replays every target's committed corpus (the fuzz_*_replay tests) instead.
FUZZ_BUILD_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= store_request handshake message_header init_url cluster_env objects idx idx_example image s3_xml csv \
                checkpoint pickle pickle_opcodes

.PHONY: all deps configure build run test stress bench clean fuzz fuzz-build fuzz-ci sanitize ci-sanitize ci-sanitize-build \
        ci-sanitize-run python-suite

all: build

deps:
	scripts/install-deps

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

configure: $(BUILD_DIR)/build.ninja

build: deps configure
	cmake --build $(BUILD_DIR)

# The main job: Fashion-MNIST, 2 ranks started by `chorus run`, one epoch, exact test accuracy at the end.
# Records and state go to runs/fashion_mnist (ignored by git); each `make run` starts afresh (--overwrite).
run: build
	$(BUILD_DIR)/bin/chorus run -n 2 $(BUILD_DIR)/bin/fashion_mnist --epochs 1 --overwrite

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure --timeout 300 $(CTEST_FLAGS)

# Every multi-process test (ctest label `multiproc`, nothing excluded) STRESS_REPEAT times in a
# row, stopping at the first failure: a race shows up here before it shows up in CI at random.
stress: build
	cd $(BUILD_DIR) && ctest --output-on-failure --repeat until-fail:$(STRESS_REPEAT) -L multiproc $(CTEST_FLAGS)

# compare-ddp runs the Accelerator example as an extra row beside the hand-written loop (the
# harness) and PyTorch DDP, its ranks pinned by `chorus run --bind-cpu` as the harness pins its own.
# CHORUS_MALLOC_TUNING=0: the harness and PyTorch run with glibc's malloc defaults, and this row
# measures what the Accelerator's own code costs, like for like (docs/accelerator.md).
ACCELERATOR_ROW = accelerator example=env CHORUS_MALLOC_TUNING=0 {bin}/chorus run -n {world} --bind-cpu {bin}/fashion_mnist --max-steps {steps} --epochs {epochs} --batch-size {batch_size} --lr {lr} --seed {seed} --threads 1 --data {data} --overwrite

bench: build
	bench/compare-gloo
	bench/compare-ddp --row '$(ACCELERATOR_ROW)'

# PyTorch 1.13's whole distributed test suite on gloo, on chorus and on chorus in gloo's place, W=2
# and 3, file:// and env:// (about 2 hours here; make test runs a subset). docs/python.md.
python-suite: build
	scripts/python-suite --build $(BUILD_DIR)

$(FUZZ_BUILD_DIR)/build.ninja:
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCHORUS_BUILD_FUZZERS=ON -DCHORUS_BUILD_TESTS=OFF -DCHORUS_BUILD_BENCHMARKS=OFF -DCHORUS_INSTALL=OFF

fuzz-build: deps $(FUZZ_BUILD_DIR)/build.ninja
	cmake --build $(FUZZ_BUILD_DIR) --target $(addprefix fuzz_,$(FUZZ_TARGETS))

# Each target for FUZZ_SECONDS, from its seeds and what earlier runs found ($(FUZZ_BUILD_DIR)/fuzz-corpus,
# not committed); crashes land in $(FUZZ_BUILD_DIR)/fuzz-crashes.
fuzz: fuzz-build
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/run-fuzzers $(FUZZ_BUILD_DIR) $(FUZZ_TARGETS)

# A short smoke run of every target (10 s each, about 2 minutes plus the build).
fuzz-ci:
	$(MAKE) fuzz FUZZ_SECONDS=10

# CI's sanitizer stage (.ci/run), sized to CI's time budget: in one clang build, the comm library
# and its core tests under ASan+UBSan (with libFuzzer's coverage, so the same objects serve both)
# and a FUZZ_CI_SECONDS run of every fuzz target without libtorch; then the threaded tests (the
# shared-memory ring's two threads, the store's server thread, the process group's worker) under
# TSan. `make sanitize` runs the whole torch-less suite; `make fuzz` runs every target for longer.
CI_ASAN_DIR ?= build-ci-asan
CI_TSAN_DIR ?= build-ci-tsan
CI_ASAN_TESTS := shm_ring_test store_test transport_errors_test supervisor_test cluster_env_test plan_test log_test objects_test
CI_TSAN_TESTS := shm_ring_test store_test transport_errors_test
CI_FUZZ_TARGETS := store_request handshake message_header init_url cluster_env objects idx image s3_xml pickle_opcodes
FUZZ_CI_SECONDS ?= 10
space := $(empty) $(empty)
SANITIZER_ENV = UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  TSAN_OPTIONS="halt_on_error=1 suppressions=$(CURDIR)/tests/sanitizers/tsan.supp"
ci-sanitize: deps
	$(MAKE) ci-sanitize-build
	$(MAKE) ci-sanitize-run
# The two builds alone (no deps: .ci/run runs this at nice 19 while make test's suite runs, in the
# CPU time the suite leaves idle), then their tests and the fuzz runs.
ci-sanitize-build:
	CC=clang CXX=clang++ cmake -S . -B $(CI_ASAN_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHORUS_WITH_TORCH=OFF \
	  -DCHORUS_BUILD_FUZZERS=ON -DCHORUS_BUILD_BENCHMARKS=OFF -DCHORUS_BUILD_EXAMPLES=OFF -DCHORUS_INSTALL=OFF
	cmake --build $(CI_ASAN_DIR) --target $(CI_ASAN_TESTS) $(addprefix fuzz_,$(CI_FUZZ_TARGETS))
	cmake -S . -B $(CI_TSAN_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHORUS_WITH_TORCH=OFF -DCHORUS_SANITIZE=thread \
	  -DCHORUS_BUILD_BENCHMARKS=OFF -DCHORUS_BUILD_EXAMPLES=OFF -DCHORUS_INSTALL=OFF
	cmake --build $(CI_TSAN_DIR) --target $(CI_TSAN_TESTS)
ci-sanitize-run:
	cd $(CI_ASAN_DIR) && $(SANITIZER_ENV) ctest --output-on-failure --timeout 600 -R '^($(subst $(space),|,$(CI_ASAN_TESTS)))$$'
	FUZZ_SECONDS=$(FUZZ_CI_SECONDS) scripts/run-fuzzers $(CI_ASAN_DIR) $(CI_FUZZ_TARGETS)
	cd $(CI_TSAN_DIR) && $(SANITIZER_ENV) ctest --output-on-failure --timeout 600 -R '^($(subst $(space),|,$(CI_TSAN_TESTS)))$$'

# The parts without libtorch (comm, launch, report, the S3 client, images, the chorus tool) and
# their tests under a sanitizer: SANITIZE=address,undefined (the default) or SANITIZE=thread, in a
# build directory of its own. UBSan stops at its first report, so a finding fails its test. Not
# part of `make test`: the build alone takes about 10 minutes on 2 cores (docs/fuzzing.md).
SANITIZE ?= address,undefined
SANITIZE_BUILD_DIR ?= build-$(subst $(comma),-,$(SANITIZE))
comma := ,
sanitize: deps
	cmake -S . -B $(SANITIZE_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCHORUS_WITH_TORCH=OFF \
	  -DCHORUS_SANITIZE=$(SANITIZE) -DCHORUS_BUILD_BENCHMARKS=OFF -DCHORUS_BUILD_EXAMPLES=OFF -DCHORUS_INSTALL=OFF
	cmake --build $(SANITIZE_BUILD_DIR)
	cd $(SANITIZE_BUILD_DIR) && UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 TSAN_OPTIONS="halt_on_error=1 suppressions=$(CURDIR)/tests/sanitizers/tsan.supp" \
	  ctest --output-on-failure --timeout 900 $(CTEST_FLAGS)

clean:
	rm -rf $(BUILD_DIR)
