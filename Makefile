# Two commands on a fresh machine:  `make run` (set up + main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MCORE_NEW := .mcore/0.19.2

.PHONY: setup run test test-bridge bridge-env lint docs bench clean skill-zip check-hosts

setup: $(VENV)/.ready

# scripts/setup: the venv, torch from the CPU wheel (a bare `torch` requirement would pull a CUDA build), the package
# with its test extras. Then what only this repository's tests need: triton, and megatron-core 0.19.2 (Python >= 3.12
# on paper but runs on 3.11) installed beside, for the differential tests.
$(VENV)/.ready: pyproject.toml scripts/setup
	scripts/setup --python $(PY)
	$(BIN)/pip install -q triton
	$(BIN)/pip install -q --ignore-requires-python --no-deps --target $(MCORE_NEW) megatron-core==0.19.2
	touch $@

run: setup
	$(BIN)/mbridge-offload validate examples/qwen3_30b_a3b_pretrain.yaml
	$(BIN)/mbridge-offload recommend --model qwen3-30b-a3b --gpu h100-80gb --num-gpus 16 --tp 2 --pp 2 --ep 4

test: setup
	$(BIN)/python -m pytest -q

# Megatron Bridge's real ConfigContainer for `validate --recipe`: bridge 0.3.1 (the newest on Python 3.11) without
# its CUDA-only dependencies, plus the pure-Python ones its config import needs; tested under a labelled TE stub.
BRIDGE := .bridge
bridge-env: $(BRIDGE)/.ready
$(BRIDGE)/.ready: | setup
	$(BIN)/pip install -q --no-deps --target $(BRIDGE)/0.3.1 megatron-bridge==0.3.1
	$(BIN)/pip install -q --target $(BRIDGE)/deps "transformers<5" "huggingface-hub<1.0" datasets omegaconf einops rich six
	touch $@

test-bridge: bridge-env
	MBRIDGE_OFFLOAD_BRIDGE_PATH="$(BRIDGE)/0.3.1:$(BRIDGE)/deps" $(BIN)/python -m pytest -q tests/config/test_recipe_bridge.py tests/runtime/test_optimizer_megatron.py -k "recipe or bridge"

lint: setup
	$(BIN)/ruff check offload tools tests benchmarks
	$(BIN)/ruff format --check offload tools tests benchmarks
	$(BIN)/mypy

docs: setup
	$(BIN)/python -m mbridge_offload_tools.docgen

bench: setup
	$(BIN)/python benchmarks/cpu_optimizer.py
	$(BIN)/python benchmarks/optimizer_load.py --output docs/benchmarks-optimizer.md
	$(BIN)/python benchmarks/cpu_activation.py

# The skill as a zip for Claude.ai (SKILL.md at the root; no venv, caches or .git).
skill-zip:
	scripts/skill-zip --out dist/mbridge-offload.zip

# Install the agent clients that install here (npm) and load the skill / plugin / MCP server in each.
check-hosts:
	scripts/check-hosts --out docs/hosts-check.txt

clean:
	rm -rf $(VENV) .mcore $(BRIDGE) dist
