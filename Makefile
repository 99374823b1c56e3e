# Two entry points (see README): `make demo` and `make test`. Each builds the
# virtual environment from nothing (pinned installs) when it is missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export MUJOCO_GL ?= egl

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==25.3
	$(BIN)/pip install -q -c constraints.txt -e '.[all]'
	touch $@

.PHONY: setup demo test
setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/robo-post run

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q
