# Two commands set up a fresh machine: `make demo` and `make test`.
# Both create .venv (from the constraints that keep MXNet 1.9.1 importable) when it is missing,
# with $(PYTHON): Python 3.8 to 3.12 (e.g. `make test PYTHON=python3.12`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mxamp-installed

.PHONY: demo test test-fast docs venv clean

venv: $(STAMP)

# MXNet 1.9.1 needs numpy < 2, which has wheels for Python 3.8 to 3.12 only: on another Python
# pip would spend minutes failing to build numpy from source, so stop at once with one line.
# It asks the Python that will run the project: .venv's when it exists, else $(PYTHON).
define CHECK_PYTHON
import sys
v = sys.version_info[:2]
if not (3, 8) <= v <= (3, 12):
    sys.exit("mxamp needs Python 3.8 to 3.12 (MXNet 1.9.1 needs numpy < 2), not %d.%d (%s): "
             "install Python 3.12, then run: make clean; make test PYTHON=python3.12" % (v + (sys.executable,)))
endef
export CHECK_PYTHON

# A venv that failed half-way (Debian/Ubuntu without the python3.X-venv package) is removed, not reused.
# The start-up hook is copied into site-packages even by `pip install -e`: a change reinstalls it.
$(STAMP): setup.py constraints.txt _mxamp_numpy_aliases.py
	@py=$(PY); test -x $$py || py=$(PYTHON); $$py -c "$$CHECK_PYTHON"
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
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

# The manual: HTML in docs/_build/html, then every example in it run (doctest), warnings as
# errors.  Sphinx (the docs extra) joins .venv on the first call, not in `make test`'s set-up.
# The HTML build reads every page afresh (-E: a warning is never hidden by a cached page);
# the doctest build reuses what it read (-d).
DOCS_STAMP := $(VENV)/.mxamp-docs-installed
SPHINX := $(PY) -m sphinx -W --keep-going -q -d docs/_build/doctrees

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(SPHINX) -E -b html docs docs/_build/html
	$(SPHINX) -b doctest docs docs/_build/doctest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
