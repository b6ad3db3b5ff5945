# Two commands on a fresh machine: `make run` and `make test`.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
MODEL   := models/yuebing-tiny

.PHONY: run test install model clean

run: $(STAMP) $(MODEL)/config.json
	$(VENV)/bin/yuebing up --model $(MODEL)

test: $(STAMP) $(MODEL)/config.json
	$(PY) -m pytest -ra; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

install: $(STAMP)

model: $(MODEL)/config.json

# vLLM's CUDA build where an NVIDIA GPU answers, its CPU build (AVX2) elsewhere.
# PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch
# (and nothing here uses them), so they go.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if nvidia-smi -L >/dev/null 2>&1; then extra=gpu; else extra=cpu; fi; \
	  $(PY) -m pip install -e ".[$$extra,test]"
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/yuebing model init --out $(MODEL) --if-missing

clean:
	rm -rf $(VENV) $(MODEL)
