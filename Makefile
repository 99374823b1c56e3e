# Two entry points (see README): `make demo` and `make test` (`make test-fast`: the edit loop).
# Each builds the virtual environment from nothing (pinned installs) when it is missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export MUJOCO_GL ?= egl
# The tests' S3 server (moto) and what it needs beyond the stack, installed without their declared
# python-dateutil<3 (the stack pins 4.0.0, which botocore runs with).
S3_TEST := moto boto3 botocore s3transfer jmespath responses xmltodict flask flask-cors blinker itsdangerous cryptography cffi pycparser

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==25.3
	$(BIN)/pip install -q -c constraints.txt -e '.[all]'
	$(BIN)/pip install -q --no-deps -c constraints.txt $(S3_TEST)
	touch $@

.PHONY: setup demo test test-fast wheel-smoke bench-setup
setup: $(VENV)/.installed

# The learning benchmarks' external peers (d3rlpy), kept out of the default install.
bench-setup: $(VENV)/.installed
	$(BIN)/pip install -q -c constraints.txt -e '.[all,bench]'

demo: $(VENV)/.installed
	$(BIN)/robo-post run

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

# The edit loop: every test but those marked slow (CLI subprocesses, training runs, fleets), in
# under 2 minutes on two cores; `make test` (CI) still runs them all.
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

# The built wheel in a fresh venv: --version, collect, train, eval and a Minari round trip.
wheel-smoke:
	PY=$(PY) bash .ci/wheel_smoke.sh
