# The two commands of the README (run, test) and the fast tier. All set up .venv first (idempotent).
# `make test` runs the tiers side by side: two xdist workers, SLURM tests on one and local engine
# tests on the other (xdist groups, tests/conftest.py), light tests wherever there is room.
.PHONY: run test test-fast venv lint

PYTEST = .venv/bin/python -m pytest
PYTEST_ARGS ?=

venv:
	@bash scripts/setup-venv.sh

run: venv
	.venv/bin/streamrl run local

test: venv
	bash scripts/slurm-test-cluster.sh start
	$(PYTEST) -q -n 2 --dist loadgroup $(PYTEST_ARGS)

# No real engines, no SLURM: what to run before each change (README, "Tests").
test-fast: venv
	$(PYTEST) -q -n 2 tests/unit -m "not slow" $(PYTEST_ARGS)

lint: venv
	.venv/bin/ruff check .
