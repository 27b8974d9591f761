# vmcache: `make demo` shows it working, `make test` runs the tests.
# Both install what they need first (Debian packages, a venv in .venv).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup lint test unit demo demo-clean fixtures bench soak libvirtd install uninstall clean deb test-host test-migrate \
	test-kernels

setup:
	scripts/setup.sh

libvirtd: setup
	scripts/libvirtd.sh

# ruff and mypy (--strict on vmcache/, a lighter profile on tests/; pyproject.toml):
# every type: ignore and noqa must still suppress something.
lint: setup
	$(VENV)/bin/ruff check vmcache tests bench
	$(VENV)/bin/mypy

test: setup libvirtd lint
	$(PY) -m pytest $(PYTEST_ARGS)

unit: setup lint
	$(PY) -m pytest -m "not live" $(PYTEST_ARGS)

demo: setup
	scripts/demo.sh

demo-clean:
	scripts/demo.sh clean

fixtures: setup
	$(PY) -m tests.record_fixtures

bench: setup
	scripts/bench.sh

# About 10 minutes: 3 domains, random writes, libvirtd restarts, agent kills (not in make test).
soak: setup
	scripts/soak.sh

# A clean Debian 12 with systemd as PID 1 (debootstrap + systemd-nspawn, root
# cached in /var/cache/vmcache-host): the README's path, the systemd path and
# the Debian package on it (README, "Testing on a clean host").
test-host:
	tests/host/cleanhost.sh run

# Two such hosts (systemd-nspawn, their own libvirtd, vmcache from its .deb, a veth between them, one
# image directory shared) and live migrations between them, checked from here (README, "Testing a live
# migration"). About 3 minutes with the root cached.
test-migrate: setup
	tests/host/migrate.sh run

# The read counter and the agent's kernel fallbacks on the kernels hosts run (docs/install.md,
# "Kernels"): tests/kernels/checks.py on this machine's kernel and in TCG VMs booting Debian 12's own
# kernel (6.1), the newest Debian cloud kernel that installs on bookworm and trixie-backports' (7.x),
# vmcache from its .deb.
test-kernels: setup
	tests/kernels/run.sh

# build/deb/vmcache_<version>_all.deb, with dpkg-buildpackage and debhelper.
deb:
	scripts/deb.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# Install on this host: /opt/vmcache venv, /usr/local/bin/vmcache, the libvirt
# hook (never over a foreign one), /etc/vmcache/vmcache.yaml if absent, and
# the systemd unit where systemd runs (docs/install.md).
install:
	scripts/install.sh

uninstall:
	scripts/install.sh --uninstall
