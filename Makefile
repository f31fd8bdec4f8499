# The two commands of the README. Both set up .venv first (idempotent).
.PHONY: run test venv lint

venv:
	@bash scripts/setup-venv.sh

run: venv
	.venv/bin/streamrl run local

test: venv
	bash scripts/slurm-test-cluster.sh start
	.venv/bin/python -m pytest -q

lint: venv
	.venv/bin/ruff check .
