# Two commands set up a fresh machine: `make demo` and `make test`.
# Both create .venv (from the constraints that keep MXNet 1.9.1 importable) when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mxamp-installed

.PHONY: demo test test-fast venv clean

venv: $(STAMP)

$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,demo]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest -ra tests

# Everything but the tests marked slow: for a quick look while developing.
test-fast: $(STAMP)
	$(PY) -m pytest -ra -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
