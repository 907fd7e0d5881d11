# The README's two commands are `make demo` and `make test`; both build .venv first if needed.
VENV   := .venv
PY     := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test-env demo test bench lint clean

setup:
	@bash scripts/setup.sh

# What only the tests need beside .venv: Debian's chromium for the viewer's browser tests and .venv-vllm, the
# real vLLM CPU server the vLLM tests run against (both idempotent)
test-env: setup
	@bash scripts/install_browser.sh
	@bash scripts/setup_vllm.sh

demo: setup
	$(VENV)/bin/cleaner demo

test: test-env
	$(PY) -m pytest -q

bench: test-env
	$(PY) -m benchmarks.run

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .venv-vllm workspace .pytest_cache
