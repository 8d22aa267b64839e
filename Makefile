# kvsparse: thin wrapper over CMake. `make run` and `make test` do all the set-up.
BUILD   ?= build
ASAN    ?= build-asan
FUZZB   ?= build-fuzz
CUDAB   ?= build-cuda
JOBS    ?= $(shell nproc)
MODEL   ?= models/tiny-needle-llama
PREFIX  ?= /usr/local
CMAKE_FLAGS ?=

# cmake --build runs make again: without this every build prints "make[1]: Entering directory"
MAKEFLAGS += --no-print-directory

.PHONY: all deps configure kvsparse build install run demo test test-quick test-asan fuzz-smoke cuda bench eval clean

all: build

deps:
	@scripts/install-deps

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null

# the kvsparse binary alone (what run, demo, bench and eval need)
kvsparse: configure
	@cmake --build $(BUILD) -j $(JOBS) --target kvsparse

# everything: kvsparse and the test binaries
build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# libkvsparse (shared and static), kvsparse.h, kvsparse.pc and the kvsparse binary under PREFIX
# (lib/, include/, lib/pkgconfig/, bin/): make install PREFIX=$$HOME/.local
install: configure
	@cmake --build $(BUILD) -j $(JOBS) --target kvsparse kvsparse_shared kvsparse_static
	cmake --install $(BUILD) --prefix $(PREFIX)

# Serves the bundled model on http://127.0.0.1:8000/v1 (OpenAI API; Ctrl-C stops it)
run: kvsparse
	./$(BUILD)/kvsparse serve -m $(MODEL)

# One generation from the command line, without the server
demo: kvsparse
	./$(BUILD)/kvsparse generate -m $(MODEL) --chat -n 48 \
	  -p "The access code for Marigold is 48213. The sky was grey over the harbour. What is the access code for Marigold?"

test: build
	ctest --test-dir $(BUILD) --output-on-failure -LE subset

# every module in a few minutes (a contributor's edit-test loop; CMakeLists.txt says what it leaves out)
test-quick: build
	ctest --test-dir $(BUILD) --output-on-failure -L quick

test-asan: deps
	@cmake -S . -B $(ASAN) -DCMAKE_BUILD_TYPE=Debug -DKVS_SANITIZE=ON -DKVS_CUDA=OFF >/dev/null
	@cmake --build $(ASAN) -j $(JOBS)
	ctest --test-dir $(ASAN) --output-on-failure -LE subset

# the CUDA backend wherever nvcc is, GPU or not (`make build` compiles it only where a GPU
# driver is): kvsparse, test_cuda and kvs_bench_kernels in build-cuda/, to carry to a GPU
# machine (scripts/gpu-check --pack, scripts/gpu-e2e --pack)
cuda: deps
	@cmake -S . -B $(CUDAB) -DCMAKE_BUILD_TYPE=Release -DKVS_CUDA=ON >/dev/null
	@cmake --build $(CUDAB) -j $(JOBS) --target kvsparse test_cuda kvs_bench_kernels

fuzz-smoke: deps
	@CC=clang cmake -S . -B $(FUZZB) -DCMAKE_BUILD_TYPE=Debug -DKVS_FUZZ=ON -DKVS_CUDA=OFF >/dev/null
	@cmake --build $(FUZZB) -j $(JOBS) --target fuzzers
	scripts/fuzz-smoke $(FUZZB)

bench: kvsparse
	./$(BUILD)/kvsparse bench model -m $(MODEL)
	@scripts/fetch-tokenizers .cache/tokenizers
	./$(BUILD)/kvsparse bench tokenizer -m .cache/tokenizers/llama3

# The retrieval table of docs/SPARSITY.md: every policy at 10% and 5% budgets, and the
# default preset with two full layers, on the 200 public prompts (CPU, ~30 min).
eval: kvsparse
	@mkdir -p out
	./$(BUILD)/kvsparse eval retrieval -m $(MODEL) --data ../shared/eval/retrieval_public.jsonl \
	  --kv-policy full,snapkv,pyramidkv,streamingllm --kv-budget 10%,5% --json | tee out/eval-retrieval.json
	./$(BUILD)/kvsparse eval retrieval -m $(MODEL) --data ../shared/eval/retrieval_public.jsonl \
	  --kv-policy snapkv,pyramidkv --kv-budget 10% --kv-full-layers 2 --json | tee out/eval-retrieval-full2.json

clean:
	rm -rf $(BUILD) $(ASAN) $(FUZZB) $(CUDAB)
