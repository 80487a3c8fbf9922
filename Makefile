# make serve: set up (first time) and start the server with the embedded model
# make test:  set up (first time) and run the whole test suite, slow end-to-end tests included
.PHONY: setup serve generate test test-fast bench bench-context peers lint

setup:
	./scripts/setup.sh

serve: setup
	.venv/bin/batchscope serve

generate: setup
	.venv/bin/batchscope generate --chat "$${PROMPT:-Tell me a short story about a robot.}"

# The browser test drives Debian's chromium through chromium-driver; the runs-database tests
# start a throwaway cluster of Debian's postgresql (tests/postgres.py).
test:
	BATCHSCOPE_EXTRA_APT="chromium chromium-driver postgresql" ./scripts/setup.sh
	.venv/bin/python -m pytest -q --durations=20

# Two workers (pytest-xdist): the fast tests are mostly Python, one process each core.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" -n 2

bench: setup
	.venv/bin/python benchmarks/engine_batching.py --repeats 5

# TTFT and decode tok/s at prompts of 512-8192 tokens, batchscope against llama-bench when
# llama.cpp is built (./scripts/build-llama-cpp.sh); batchscope only without it
bench-context: setup
	.venv/bin/python benchmarks/context_length.py

# batchscope vs mlx-lm batch_generate and mlx_lm.server, static vs continuous batching, and the
# max_num_seqs sweep, in one long run (it prints its time estimate first; QUICK=1 for a smoke
# test)
peers: setup
	.venv/bin/python benchmarks/peers.py $(if $(QUICK),--quick)

# ruff, and the import contracts of .importlinter (engine/ knows no web or database code,
# app's layers point one way, no cycles among sibling modules)
lint: setup
	.venv/bin/ruff check engine app tests benchmarks scripts
	.venv/bin/lint-imports
