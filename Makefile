# The two commands of the README (run, test), the fast tier and the docs site. All set up .venv
# first (idempotent).
# `make test` runs on two xdist workers: the SLURM tests as one scope on one, the e2e modules (longest
# first) then the unit modules on whichever is free (tests/conftest.py, pytest_xdist_make_scheduler).
.PHONY: run test test-fast venv lint docs

PYTEST = .venv/bin/python -m pytest
PYTEST_ARGS ?=

venv:
	@bash scripts/setup-venv.sh

run: venv
	.venv/bin/streamrl run local

test: venv
	bash scripts/slurm-test-cluster.sh start
	$(PYTEST) -q -n 2 $(PYTEST_ARGS)

# No real engines, no SLURM: what to run before each change (docs/contributing.md).
test-fast: venv
	$(PYTEST) -q -n 2 tests/unit -m "not slow" $(PYTEST_ARGS)

lint: venv
	.venv/bin/ruff check .

# The docs site from docs/ (mkdocs.yml) into site/; --strict: a broken link or anchor fails.
docs: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
