#!/bin/sh
# The whole suite as two pytest runs at once: the container tests (-m system)
# mostly wait for debootstrap, apt and booting machines, the rest mostly for
# servers, timers and fsyncs, so on two cores together they take about the
# time of the longer half rather than the sum. The tests marked "waits" (one
# spends two minutes at the defaults' timing) join the container tests, which
# evens the halves. The first run's output goes to a log, printed whole once
# both runs end, so neither interleaves.
# Usage: scripts/run-tests.sh <venv bin directory> [pytest arguments for both]
set -u
bin=$1
shift
mkdir -p build
log=build/test-system.log
# No cache plugin: both runs would write .pytest_cache at once.
"$bin/pytest" -m "system or waits" -p no:cacheprovider "$@" >"$log" 2>&1 &
system=$!
"$bin/pytest" -m "not system and not waits" "$@"
rest=$?
wait "$system"
system_rc=$?
echo
echo "== the container tests and the waiting ones (pytest -m 'system or waits'), from $log:"
cat "$log"
echo "== pytest -m 'not system and not waits' exited $rest, pytest -m 'system or waits' exited $system_rc"
[ "$rest" -eq 0 ] && [ "$system_rc" -eq 0 ]
