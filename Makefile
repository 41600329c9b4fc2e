# The front door. `make demo` and `make test` do all set-up themselves on a fresh Debian/Ubuntu
# machine (as root): `setup` is idempotent, so every target that needs the virtualenv depends on it.

VENV   := .venv
PY     := $(VENV)/bin/python
# -p no:cacheprovider: no .pytest_cache in the tree; -ra: a one-line reason for every test that did
# not pass (skips included, so a skipped FUSE suite is visible); --strict-markers: a typo in a
# marker is an error, not a silently unselected test.
# -n $(PYTEST_WORKERS) --dist loadfile: test files run on three workers (pytest-xdist), each file whole on
# one worker, so module fixtures stay together; most tests wait on FUSE, S3 and subprocesses, so three
# workers shorten the wall time even on 2 cores (measured with .ci/run: two workers 13:17-16:01 of
# pytest for the same code, three 11:41-11:49). PYTEST_WORKERS=0 runs everything in one process.
# --no-loadscope-reorder: files go out in collection order, which tests/conftest.py sorts longest first
# (xdist's default order, by number of tests, left the longest file for the end).
PYTEST_WORKERS ?= 3
PYTEST_FLAGS ?= -q -p no:cacheprovider -ra --strict-markers -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: all setup demo s3 s3-stop test pytest lint-imports typecheck docs bench bench-full bench-cluster clean help

all: test

help:
	@echo "make setup         system packages (fuse3, fio) and $(VENV)"
	@echo "make demo          a local SeaweedFS + a sample dataset, mounted, read twice, verified"
	@echo "make s3            a local SeaweedFS that stays up (after the demo, to go on trying things); prints the"
	@echo "                   environment to use it (also in .demo/s3/env); make s3-stop stops it"
	@echo "make test          the test suite, the import contracts, the type check and the docs; one summary line each"
	@echo "make lint-imports  the import-layer contracts only"
	@echo "make typecheck     mypy over the product packages only"
	@echo "make docs          the documentation site (mkdocs, strict) into site/"
	@echo "make bench         cachefs vs rclone mount vs s3fs-fuse vs raw GET engines on a local SeaweedFS"
	@echo "                   (<= 15 min on 2 cores; BENCH_ARGS=\"--size 256MiB --rounds 1\" for a short one); docs/benchmarks.md"
	@echo "make bench-full    every figure: 10,000-file epochs, listing, writes, hit ratio, then a 4-node cluster (~1 h)"
	@echo "make bench-cluster 4 nodes, one dataset, a throttled source and a shared cluster tier (root;"
	@echo "                   BENCH_CLUSTER_ARGS=\"--size 256MiB\"); results in bench-results/cluster.{json,md}"
	@echo "make clean         remove $(VENV), build outputs and caches"

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

# A local S3 store that outlives the command (scripts/s3.py): every port, gRPC ones included, chosen
# free on 127.0.0.1; its environment is printed and written to .demo/s3/env; data and keys are kept.
s3: setup
	$(PY) scripts/s3.py start

s3-stop:
	$(PY) scripts/s3.py stop

# The type check covers the product packages (config: [tool.mypy] in pyproject.toml), so a misspelt
# member of a Protocol, a store or a settings object fails the build.
TYPED_PACKAGES := tiering cachefs csi_driver

# All four parts always run, so one failure does not hide another; the target fails if any did. It ends
# with one line per part (passed or FAILED, the time, the part's own last line: pytest's counts, ...),
# right above make's own error line (scripts/testparts.py).
test: setup
	@$(PY) scripts/testparts.py \
	  "pytest=$(PY) -m pytest $(PYTEST_FLAGS) $(PYTEST_ARGS)" \
	  "import contracts=$(VENV)/bin/lint-imports" \
	  "mypy=$(PY) -m mypy $(TYPED_PACKAGES)" \
	  "docs=$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(DOCS_SITE)"

pytest: setup
	$(PY) -m pytest $(PYTEST_FLAGS) $(PYTEST_ARGS)

lint-imports: setup
	$(VENV)/bin/lint-imports

typecheck: setup
	$(PY) -m mypy $(TYPED_PACKAGES)

# The documentation site (mkdocs.yml): strict, so a broken link or anchor, or a page missing from the
# navigation, fails the build. `make test` builds it into a scratch directory.
DOCS_SITE ?= site
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir $(DOCS_SITE)

# The side-by-side benchmark (benchmarks/bench.py): not part of `make test` (its smoke test is).
# setup.sh --bench also checks that the peers (rclone, s3fs) run; results go to bench-results/.
# `make bench` is the quick set (<= 15 min on 2 cores); `make bench-full` the hour-long figures
# (10,000-file epochs, listing, writes, hit ratio beyond the disk tier) and the 4-node cluster.
BENCH_ARGS ?=
BENCH_FULL_ARGS ?=
bench:
	bash scripts/setup.sh --bench
	$(PY) -m benchmarks.bench $(BENCH_ARGS)

bench-full:
	bash scripts/setup.sh --bench
	$(PY) -m benchmarks.bench --set full --out bench-results/full $(BENCH_FULL_ARGS)
	$(PY) -m benchmarks.cluster --nodes 4 --out bench-results/full $(BENCH_CLUSTER_ARGS)

# The shared cluster tier's benchmark (benchmarks/cluster.py): two local SeaweedFS, one behind a
# throttled proxy; not part of `make test` (its smoke test is).
bench-cluster:
	$(PY) -m benchmarks.cluster $(BENCH_CLUSTER_ARGS)

# Refuses while anything under the tree is still mounted: rm -rf would otherwise walk into a live
# mount (a demo interrupted with kill -9 can leave one behind).
clean:
	@left=$$(awk -v d="$(CURDIR)/" 'index($$5, d) == 1 {print "  " $$5}' /proc/self/mountinfo 2>/dev/null); \
	if [ -n "$$left" ]; then \
	  echo "clean: still mounted under $(CURDIR) (run 'cachefs unmount PATH' first):" >&2; \
	  echo "$$left" >&2; \
	  exit 1; \
	fi
	@if [ -x $(PY) ] && [ -f .demo/s3/state.json ]; then $(PY) scripts/s3.py stop; fi
	rm -rf $(VENV) build dist site .demo bench-results .pytest_cache .hypothesis .mypy_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
