# marinfs: `make run` mounts $MARIN_PREFIX (or /tmp/marin) at $MARINFS_MOUNT (or ./mnt);
# `make test` runs the whole suite. Both install what a fresh Debian machine lacks.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
REMOTE := $(or $(MARIN_PREFIX),/tmp/marin)
MOUNT := $(or $(MARINFS_MOUNT),./mnt)

.PHONY: run test bench system-deps venv clean

system-deps:
	@command -v fusermount3 >/dev/null && command -v rsync >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq fuse3 rsync; }

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

run: system-deps venv
	@if [ -z "$(MARIN_PREFIX)" ]; then mkdir -p /tmp/marin; fi
	@mkdir -p "$(MOUNT)"
	@echo "marinfs: mounting $(REMOTE) at $(abspath $(MOUNT)) in the foreground;" \
	      "stop with Ctrl-C or: $(VENV)/bin/marinfs umount $(abspath $(MOUNT))"
	$(VENV)/bin/marinfs mount "$(REMOTE)" "$(MOUNT)" --foreground

test: system-deps venv
	$(VENV)/bin/python -m pytest

bench: system-deps venv
	$(VENV)/bin/python benchmarks/read_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
