# Thin wrapper over CMake. `make` builds build/bin/tandem; `make test` installs, builds, tests;
# `make serve` installs, builds and serves the embedded default.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release

.PHONY: all deps configure build test test-stress test-asan test-tsan serve bench format clean

all: build

deps:
	./scripts/install-deps

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) $(CMAKE_FLAGS)

configure: $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: deps
	$(MAKE) build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) -LE gpu

# The suite with every core saturated, then the worker/disagg/chaos/api tests 5 times (not in CI).
test-stress: deps
	$(MAKE) build
	./scripts/test-stress $(BUILD_DIR)

# Sanitizer builds in build-asan/ and build-tsan/; any finding fails the run (not in CI).
# ASan+UBSan+LSan: every test but the gpu label. TSan: the worker, router, KV and cluster tests.
test-asan: deps
	JOBS=$(JOBS) ./scripts/test-sanitizers asan

test-tsan: deps
	JOBS=$(JOBS) ./scripts/test-sanitizers tsan

serve: deps
	$(MAKE) build
	$(BUILD_DIR)/bin/tandem serve

bench: build
	$(BUILD_DIR)/bin/tandem_bench_kernels
	$(BUILD_DIR)/bin/tandem_bench_decode

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)
