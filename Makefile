# The README's two commands are `make demo` and `make test`; both build .venv first if needed.
VENV   := .venv
PY     := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/cleaner demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.run

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) workspace .pytest_cache
