.PHONY: install demo test style quality bench

install:
	bash scripts/install.sh

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

style:
	.venv/bin/ruff format accelerate_zero tests recipes bench
	.venv/bin/ruff check --fix accelerate_zero tests recipes bench

quality:
	.venv/bin/ruff format --check accelerate_zero tests recipes bench
	.venv/bin/ruff check accelerate_zero tests recipes bench

bench:
	.venv/bin/python bench/engine_bench.py
