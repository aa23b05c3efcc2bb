# Two commands on a fresh machine:  `make run` (set up + main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-long test-bridge bridge-env lint docs bench clean skill-zip check-hosts

setup: $(VENV)/.ready

# scripts/setup, the one set-up command: the venv, torch from the CPU wheel (a bare `torch` requirement would pull a
# CUDA build), the package with its test extras, megatron-core 0.19.2 beside it in .mcore/0.19.2 (validate --exact's
# default target and the differential tests) and the triton it imports. Nothing is installed here beyond it.
$(VENV)/.ready: pyproject.toml scripts/setup
	scripts/setup --python $(PY)
	touch $@

run: setup
	$(BIN)/mbridge-offload validate examples/qwen3_30b_a3b_pretrain.yaml
	$(BIN)/mbridge-offload recommend --model qwen3-30b-a3b --gpu h100-80gb --num-gpus 16 --tp 2 --pp 2 --ep 4

# The suite on every core (pytest-xdist; a file's tests stay on one worker, so module fixtures are built once), less the
# long differential and mutation runs, which `make test-long` runs (CI runs both).
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadfile
test: setup
	$(PYTEST) -m "not long"

test-long: setup
	$(PYTEST) -m long

# Megatron Bridge's real ConfigContainer for `validate --recipe` and the recipe tests, two releases, without their
# CUDA-only dependencies:
# - 0.3.1 (the newest that declares Python 3.11) with megatron-core 0.16.1 (the venv's), deps in .bridge/deps;
# - 0.6.2 (the newest; declares Python >= 3.12 but its source runs on 3.11) with megatron-core 0.19.2 (.mcore/0.19.2),
#   its pure-Python deps in .bridge/deps-0.6.2, appended after the venv's packages so the CPU torch stays first.
# Both are tested under LABELLED SHIMS (tests/support/te_stub.py: a Transformer Engine import stub, __version__ 2.12.0
# for 0.3.1 and 2.18.0, Bridge 0.6.2's pin, for 0.6.2; tests/support/bridge062.py: typing.override on Python 3.11).
BRIDGE := .bridge
BRIDGE_DEPS_062 := "transformers>=5.8,<=5.12.1" huggingface-hub datasets "omegaconf>=2.3,<2.4" einops rich six \
	tensorboard requests safetensors pulp jmespath xattr wcmatch lark prettytable pyroute2 braceexpand filetype mfusepy \
	rapidyaml s3fs webdataset
# Their own requirements would pull a CUDA torch: installed without dependencies (the ones above cover their imports).
BRIDGE_NODEPS_062 := megatron-energon multi-storage-client diffusers nvidia-modelopt
bridge-env: $(BRIDGE)/.ready $(BRIDGE)/.ready-0.6.2
$(BRIDGE)/.ready: | setup
	$(BIN)/pip install -q --no-deps --target $(BRIDGE)/0.3.1 megatron-bridge==0.3.1
	$(BIN)/pip install -q --target $(BRIDGE)/deps "transformers<5" "huggingface-hub<1.0" datasets omegaconf einops rich six
	touch $@
$(BRIDGE)/.ready-0.6.2: | setup
	$(BIN)/pip install -q --no-deps --ignore-requires-python --target $(BRIDGE)/0.6.2 megatron-bridge==0.6.2
	$(BIN)/pip install -q --target $(BRIDGE)/deps-0.6.2 $(BRIDGE_DEPS_062)
	$(BIN)/pip install -q --no-deps --upgrade --target $(BRIDGE)/deps-0.6.2 $(BRIDGE_NODEPS_062)
	touch $@

# 0.3.1 through MBRIDGE_OFFLOAD_BRIDGE_PATH; the 0.6.2 tests find .bridge/0.6.2 themselves (tests/support/bridge062.py).
test-bridge: bridge-env
	MBRIDGE_OFFLOAD_BRIDGE_PATH="$(BRIDGE)/0.3.1:$(BRIDGE)/deps" $(BIN)/python -m pytest -q tests/config/test_recipe_bridge.py tests/runtime/test_optimizer_megatron.py -k "recipe or bridge"
	MBRIDGE_OFFLOAD_BRIDGE_PATH="$(BRIDGE)/0.6.2" $(BIN)/python -m pytest -q tests/config/test_bridge062_fixtures.py tests/config/test_bridge062.py \
		tests/config/test_bridge_mixed_precision.py

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
