# Every set-up step lives here (or in the scripts it calls), so a bare Debian 12
# machine and CI get the same environment as a developer.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Build needs of systemd-python (libsystemd-dev, pkg-config, a C compiler, the
# Python headers) and the venv module.
APT_BUILD := python3-venv python3-dev libsystemd-dev pkg-config gcc
# What the tests use beyond Python: the container tests boot a real systemd;
# the store suite also runs on a throwaway PostgreSQL cluster; strace shows
# what reaches the disk, and when (a commit before its 201, for one); perf
# traces the scheduler and the block layer for the bench's --disk-trace.
APT_TEST := systemd-container debootstrap
# promtool tests the shipped alert rules; a real Prometheus fires one.
APT_PROM := prometheus
APT_PG := postgresql postgresql-client
APT_TRACE := strace linux-perf
# The man pages are rendered by the tests as man and lintian render them.
APT_MAN := groff-base man-db
APT_BENCH := wrk redis-server
# The Debian package (debian/): one .deb per release, each built in a clean
# tree of that release (scripts/build_deb.py), into dist/deb/<suite>/.
DEB_SUITES ?= bookworm trixie
# `make lock` resolves requirements/*.txt with this uv, in a venv of its own.
UV_VERSION ?= 0.13.9
LOCK_VENV := build/lock-venv

.PHONY: help venv run test test-unit test-system lint bench deb lock install uninstall clean

help:
	@echo "make run          run toko-api on 127.0.0.1:8080 (SQLite in ./var, mail to the log)"
	@echo "make test         lint and the whole test suite (unit, integration, system)"
	@echo "make test-unit    the tests without the systemd container"
	@echo "make test-system  only the systemd container tests"
	@echo "make bench        load benchmarks (results in bench/results/; BENCH_ARGS=\"--smoke -s a\")"
	@echo "make deb          the Debian packages for $(DEB_SUITES) (dist/deb/<suite>/)"
	@echo "make lock         refresh the hash-locked requirements the package is built from"
	@echo "sudo make install   build the package for this host's Debian and apt-get install it"
	@echo "sudo make uninstall apt-get remove toko (keeps /etc/toko and /var/lib/toko)"

# What running toko needs, and no more: `make run` stops here.
$(BIN)/.runtime-installed: pyproject.toml
	./scripts/ensure-apt.sh $(APT_BUILD)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

# The test and lint tools on top.
$(BIN)/.installed: $(BIN)/.runtime-installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

run: $(BIN)/.runtime-installed
	mkdir -p var
	TOKO_LISTEN=$${TOKO_LISTEN:-127.0.0.1:8080} TOKO_DATABASE=$${TOKO_DATABASE:-var/toko.db} \
		$(BIN)/toko-api

lint: venv
	$(BIN)/ruff check service jobs tests bench scripts
	$(BIN)/ruff format --check service jobs tests bench scripts
	$(BIN)/mypy
	$(BIN)/python -m scripts.check_links README.md docs

test: venv lint
	./scripts/ensure-apt.sh $(APT_TEST) $(APT_PG) $(APT_TRACE) $(APT_MAN) $(APT_PROM)
	./scripts/run-tests.sh $(BIN)

test-unit: venv
	./scripts/ensure-apt.sh $(APT_PG) $(APT_TRACE) $(APT_MAN) $(APT_PROM)
	$(BIN)/pytest -m "not system"

test-system: venv
	./scripts/ensure-apt.sh $(APT_TEST)
	$(BIN)/pytest -m system

$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

# Postfix's smtp-sink and smtp-source, the C SMTP server and client email
# throughput is measured with: unpacked from the Debian package into build/,
# never installed (the package would set up and start a mail server).
bench: venv $(BIN)/.bench-installed
	./scripts/ensure-apt.sh $(APT_BENCH) $(APT_PG) $(APT_TRACE)
	$(BIN)/python -m bench.postfix
	$(BIN)/python -m bench $(BENCH_ARGS)

deb:
	./scripts/ensure-apt.sh $(APT_TEST)
	for suite in $(DEB_SUITES); do $(PYTHON) scripts/build_deb.py --suite $$suite || exit 1; done

$(LOCK_VENV)/.uv-$(UV_VERSION):
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q 'uv==$(UV_VERSION)'
	touch $@

# Newest versions for every Python from 3.11 (Debian 12) on, with the hashes of
# all their files: the package build installs nothing else (--require-hashes).
lock: $(LOCK_VENV)/.uv-$(UV_VERSION)
	$(LOCK_VENV)/bin/uv pip compile --quiet --upgrade --universal --generate-hashes \
		--python-version 3.11 --custom-compile-command "make lock" \
		pyproject.toml -o requirements/runtime.txt
	$(LOCK_VENV)/bin/uv pip compile --quiet --upgrade --universal --generate-hashes \
		--python-version 3.11 --custom-compile-command "make lock" \
		requirements/build.in -o requirements/build.txt

# A bare server builds for its own release with its own python3 (the build
# installs what debian/control's Build-Depends lists), then installs the package.
install:
	./scripts/ensure-apt.sh python3
	deb=$$($(PYTHON) scripts/build_deb.py --suite host) && apt-get install -y "$$deb"

uninstall:
	apt-get remove -y toko

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
