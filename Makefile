# eksft-nb: every target sets up what it needs (a .venv in this folder) on a fresh machine.
#   make lab    set up, run the headless terminal demo, then open JupyterLab on the quickstart
#   make test   set up (venv + Chromium for the browser test) and run the test suite
#   make demo   set up and run the headless demo only
#   make bench  set up and run the benchmarks (make bench-quick: the short version)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU build that lies on this kind of machine; on a GPU machine use e.g.
# `make lab TORCH_SPEC=torch` to let pip pick a CUDA build.
TORCH_SPEC ?= torch==2.13.0
CHROMIUM := /usr/lib/chromium/chromium
LAB_PORT ?= 8888
DEMO_NAME ?= demo-$(shell date +%H%M%S)

.PHONY: setup lab demo test bench bench-quick chromium clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
	  echo "installing Chromium for the browser tests (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null; \
	fi

demo: setup
	$(PY) -m eksft_nb run --name $(DEMO_NAME) --steps 80 --model tiny --ckpt-every 10 \
	  --fault exception:0@15 --fault sigkill:1@30 --fault hang:0@45 --fault kill-launcher@60

lab: demo
	$(VENV)/bin/jupyter lab --port=$(LAB_PORT) $(if $(filter 0,$(shell id -u)),--allow-root,) \
	  notebooks/01_quickstart.ipynb

test: setup chromium
	$(PY) -m pytest -q

bench: setup
	$(PY) -m bench

bench-quick: setup
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
