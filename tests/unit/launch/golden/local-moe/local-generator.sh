# generator on this machine: one local process per line
PYTHON -u -m streamrl_cli.roles /RUN_DIR/roles/generator.yaml --rank 0
