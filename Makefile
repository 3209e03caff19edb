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
# what reaches the disk, and when (a commit before its 201, for one).
APT_TEST := systemd-container debootstrap
APT_PG := postgresql postgresql-client
APT_TRACE := strace
APT_BENCH := wrk redis-server

.PHONY: help venv run test test-unit test-system lint bench install uninstall clean

help:
	@echo "make run          run toko-api on 127.0.0.1:8080 (SQLite in ./var, mail to the log)"
	@echo "make test         lint and the whole test suite (unit, integration, system)"
	@echo "make test-unit    the tests without the systemd container"
	@echo "make test-system  only the systemd container tests"
	@echo "make bench        load benchmarks (results in bench/results/; BENCH_ARGS=\"--smoke -s a\")"
	@echo "sudo make install / uninstall   deploy as systemd services"

$(BIN)/.installed: pyproject.toml
	./scripts/ensure-apt.sh $(APT_BUILD)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

run: venv
	mkdir -p var
	TOKO_LISTEN=$${TOKO_LISTEN:-127.0.0.1:8080} TOKO_DATABASE=$${TOKO_DATABASE:-var/toko.db} \
		$(BIN)/toko-api

lint: venv
	$(BIN)/ruff check service jobs tests bench
	$(BIN)/ruff format --check service jobs tests bench
	$(BIN)/mypy

test: venv lint
	./scripts/ensure-apt.sh $(APT_TEST) $(APT_PG) $(APT_TRACE)
	$(BIN)/pytest

test-unit: venv
	./scripts/ensure-apt.sh $(APT_PG) $(APT_TRACE)
	$(BIN)/pytest -m "not system"

test-system: venv
	./scripts/ensure-apt.sh $(APT_TEST)
	$(BIN)/pytest -m system

$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

bench: venv $(BIN)/.bench-installed
	./scripts/ensure-apt.sh $(APT_BENCH) $(APT_PG)
	$(BIN)/python -m bench $(BENCH_ARGS)

install:
	./deploy/install.sh

uninstall:
	./deploy/uninstall.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
