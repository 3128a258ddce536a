# eksft-nb: every target sets up what it needs (a .venv in this folder, with the JupyterLab extension built
# from nbext/) on a fresh machine.
#   make lab    set up, run the headless terminal demo, then open JupyterLab on the quickstart
#   make test   set up (venv, NVRx 0.6.0 and 0.7.0 beside it, Chromium for the browser test, Prometheus for the
#               dashboard test) and run the test suite
#   make demo   set up and run the headless demo only
#   make bench  set up and run the benchmarks, each run's JSON kept in bench/results/ (bench-quick: short)
#   make docs   set up and build the docs site (docs/, Sphinx + MyST) into build/docs/html

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU build that lies on this kind of machine; on a GPU machine use e.g.
# `make lab TORCH_SPEC=torch` to let pip pick a CUDA build.
TORCH_SPEC ?= torch==2.13.0
CHROMIUM := /usr/lib/chromium/chromium
LAB_PORT ?= 8888
DEMO_NAME ?= demo-$(shell date +%H%M%S)

.PHONY: setup lab demo test bench bench-quick docs chromium prometheus slurm system-tools clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch and the project in one resolve (torch pinned to TORCH_SPEC); nbext/ is built below
	SKIP_JUPYTER_BUILDER=1 $(PY) -m pip install -q "$(TORCH_SPEC)" -e '.[dev]'
	touch $@

# Two more NVRx releases for the tests, beside the one pip resolved (0.4.1 where glibc < 2.39): 0.7.0, what
# GPU machines resolve (Python 3.12), runs the full NVRx matrix; 0.6.0 a smoke set (docs/nvrx-versions.md).
# Their wheels are tagged manylinux_2_39 (0.7.0: cp312 only) but their one compiled file is the CUDA-only
# CUPTI extension and their Python runs on 3.11, so each is unpacked with --target; a test puts its folder
# first on PYTHONPATH. What they require beyond the venv goes into the same folder, --no-deps (nothing else
# in the venv sees it, and nothing of the venv is shadowed): gRPC/protobuf; for 0.7.0 also its attribution
# service's web stack (fastapi, pydantic-settings, slowapi, uvicorn: the venv has pydantic). The rest
# (numpy, psutil>=6, pyyaml, packaging, httpx, defusedxml, nvidia-ml-py) the venv has.
NVRX_RELEASES := 0.6.0 0.7.0
NVRX_GRPC := "grpcio>=1.76,<2" "grpcio-tools>=1.76,<2" "protobuf>=4.22"
NVRX_0.6.0_PY := 3.11
NVRX_0.7.0_PY := 3.12
NVRX_0.6.0_EXTRA :=
NVRX_0.7.0_EXTRA := fastapi starlette annotated-doc pydantic-settings python-dotenv slowapi limits deprecated \
  wrapt uvicorn
NVRX_DIRS := $(foreach r,$(NVRX_RELEASES),$(VENV)/nvrx-$(r))

$(VENV)/nvrx-%/.installed: $(VENV)/.installed
	rm -rf $(VENV)/nvrx-$*
	$(PY) -m pip install -q --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 \
	  --python-version $(NVRX_$*_PY) --target $(VENV)/nvrx-$* nvidia-resiliency-ext==$*
	$(PY) -m pip install -q --no-deps --only-binary=:all: --upgrade --target $(VENV)/nvrx-$* \
	  $(NVRX_GRPC) $(NVRX_$*_EXTRA)
	$(PY) -m pip install -q defusedxml httpx "nvidia-ml-py>=12.570.86" packaging "psutil>=6" pyyaml
	touch $@

# The JupyterLab extension (nbext/, TypeScript), built by the function a wheel's build hook calls
# (nbext/build.py: npm ci from the committed lock file, then `npm run build:prod`: tsc, JupyterLab's builder)
# into eksft_nb/labextension/, installed as a prebuilt extension into the venv, as `pip install` of a wheel
# does. One build path: the wheel test packs this build rather than making its own. It re-runs when its inputs
# change (a cold run: about 40 s; needs Node.js >= 20.19 and npm).
LABEXT := $(VENV)/share/jupyter/labextensions/eksft-nb-labextension
NBEXT_SRC := $(wildcard nbext/src/*.ts) $(wildcard nbext/style/*) nbext/tsconfig.json nbext/install.json \
  nbext/package.json nbext/package-lock.json nbext/build.py

$(VENV)/.nbext-installed: $(NBEXT_SRC) $(VENV)/.installed
	@command -v npm >/dev/null || { echo "eksft: error: npm is missing, needed to build the JupyterLab extension" \
	  "→ install Node.js >= 20.19 with npm (e.g. apt-get install nodejs npm)"; exit 1; }
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -c 'from nbext.build import build; build("standard", "")' \
	  >/dev/null
	rm -rf $(LABEXT) && mkdir -p $(dir $(LABEXT)) && cp -r eksft_nb/labextension $(LABEXT)
	cp nbext/install.json $(LABEXT)/
	touch $@

setup: $(VENV)/.installed $(NVRX_DIRS:%=%/.installed) $(VENV)/.nbext-installed

# The server extension behind the JupyterLab panel (eksft_nb.lab), enabled in the venv: an editable
# install does not copy pyproject's data files.
SERVER_EXT_CONF := $(VENV)/etc/jupyter/jupyter_server_config.d/eksft_nb.json
$(SERVER_EXT_CONF): jupyter-config/jupyter_server_config.d/eksft_nb.json $(VENV)/.installed
	install -D -m 644 $< $@
setup: $(SERVER_EXT_CONF)

# What the tests need from the system (apt): Chromium for the browser tests; Prometheus for the dashboard test
# (the real server, started by the test on a free port with its own config and storage); Slurm for the Slurm
# backend tests (a real controller and two node daemons that tests/slurm_cluster.py starts on free ports in a
# temporary folder). The packages' own services play no part. Each tool: how to tell it is there, its packages.
chromium_there := test -x $(CHROMIUM)
chromium_packages := chromium fonts-liberation
prometheus_there := command -v prometheus >/dev/null
prometheus_packages := prometheus
slurm_there := command -v slurmctld >/dev/null
slurm_packages := slurm-wlm
SYSTEM_TOOLS := chromium prometheus slurm

# the missing ones of the tools $(1), with one apt-get update and one apt-get install
apt_install = missing=""; $(foreach t,$(1),$($(t)_there) || missing="$$missing $($(t)_packages)";) \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing for the tests (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends $$missing >/dev/null; \
	fi

$(SYSTEM_TOOLS):
	@$(call apt_install,$@)

system-tools:
	@$(call apt_install,$(SYSTEM_TOOLS))

demo: setup
	$(PY) -m eksft_nb run --name $(DEMO_NAME) --steps 80 --model tiny --ckpt-every 10 \
	  --fault exception:0@15 --fault sigkill:1@30 --fault hang:0@45 --fault kill-launcher@60

lab: demo
	$(VENV)/bin/jupyter lab --port=$(LAB_PORT) $(if $(filter 0,$(shell id -u)),--allow-root,) \
	  notebooks/01_quickstart.ipynb

# two workers: the tests wait on real processes (timeouts, schedulers, browsers) as much as they compute;
# tests/conftest.py keeps what shares one Slurm on one worker
test: setup system-tools
	$(PY) -m pytest -q -n 2

bench: setup
	$(PY) -m bench

bench-quick: setup
	$(PY) -m bench --quick

# The docs site, as tests/test_docs.py builds it (warnings are errors); the tutorials are the committed
# notebooks, not run. Python only: it needs neither the JupyterLab extension nor NVRx's second release.
DOCS_OUT := build/docs
docs: $(VENV)/.installed
	$(PY) -m sphinx -W --keep-going -q -b html -d $(DOCS_OUT)/doctrees docs $(DOCS_OUT)/html
	@echo "docs: $(DOCS_OUT)/html/index.html"

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info nbext/node_modules nbext/lib eksft_nb/labextension
