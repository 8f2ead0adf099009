# make demo : create .venv if missing, install, fetch the default model, run the decoder on it.
# make test : the same set-up, then the whole test suite on an 8-device CPU-emulated mesh.
# Both are fast the second time: the venv and the model cache are reused.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export EAGLE3_JAX_HOME ?= $(HOME)/.cache/eagle3_jax

.PHONY: setup model demo test bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

setup: $(STAMP)

model: $(STAMP)
	$(PY) -m eagle3_jax.checkpoints.default_model

demo: model
	$(PY) -m eagle3_jax.decode

test: model
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -q tests

bench: model
	$(PY) -m eagle3_jax.bench forward

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
