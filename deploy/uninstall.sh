#!/bin/sh
# Remove what deploy/install.sh installed, except the data:
#   sudo make uninstall
# Stops and disables the units, removes them (with the sandbox drop-in they
# share), the virtualenv in /opt/toko and an unchanged /etc/toko/toko.env.
# Keeps /var/lib/toko (database and backups), an edited toko.env, the API
# token /etc/toko/api-token, admin drop-ins in /etc/systemd/system/toko-*.d and
# the system user toko that owns the data, so a later install picks them up
# again.
set -eu

PREFIX=/opt/toko
UNIT_DIR=/usr/local/lib/systemd/system
CONF_DIR=/etc/toko
DATA_DIR=/var/lib/toko
UNITS="toko-api.socket toko-api.service toko-recap.service toko-recap.timer toko-backup.service toko-backup.timer toko-alert@.service"
ENABLED="toko-api.socket toko-api.service toko-recap.timer toko-backup.timer"
# The units' shared sandbox (deploy/systemd/toko-.service.d/), as install.sh has it.
DROP_INS="toko-.service.d/00-hardening.conf"

say() { echo "toko uninstall: $*"; }

[ "$(id -u)" -eq 0 ] || {
    echo "toko uninstall: error: run as root: sudo make uninstall" >&2
    exit 1
}
SRC=$(cd "$(dirname "$0")/.." && pwd)

if [ -d /run/systemd/system ]; then
    say "stopping and disabling the units"
    # Timers, socket and service in one go, so that neither a timer nor a
    # connection starts anything again; then whatever job may still run.
    # shellcheck disable=SC2086 # one word a unit
    systemctl disable --now --quiet $ENABLED 2>/dev/null || true
    systemctl stop toko-recap.service toko-backup.service 'toko-alert@*.service' 2>/dev/null || true
    # shellcheck disable=SC2086
    systemctl reset-failed $ENABLED toko-recap.service toko-backup.service 'toko-alert@*.service' \
        2>/dev/null || true
fi

removed=""
for unit in $UNITS $DROP_INS; do
    if [ -e "$UNIT_DIR/$unit" ]; then
        rm -f "$UNIT_DIR/$unit"
        removed="$removed $unit"
    fi
done
# Its folder, unless something else is in it (not ours: kept).
for dropin in $DROP_INS; do rmdir "$(dirname "$UNIT_DIR/$dropin")" 2>/dev/null || true; done
say "removed units:${removed:- none}"
if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

if [ -d "$PREFIX" ]; then
    say "removing $PREFIX"
    rm -rf "$PREFIX"
fi

if [ -f "$CONF_DIR/toko.env" ] && [ -f "$SRC/deploy/toko.env.example" ] &&
    ! cmp -s "$CONF_DIR/toko.env" "$SRC/deploy/toko.env.example"; then
    say "keeping your edited $CONF_DIR/toko.env (remove it by hand if unwanted)"
else
    rm -f "$CONF_DIR/toko.env"
    rmdir "$CONF_DIR" 2>/dev/null || true
fi

if [ -f "$CONF_DIR/api-token" ]; then
    say "keeping the API token $CONF_DIR/api-token, so clients still work after a reinstall"
fi
for d in /etc/systemd/system/toko-*.d; do
    if [ -n "$(ls -A "$d" 2>/dev/null)" ]; then say "keeping admin drop-ins in $d"; fi
done
say "done. The data is kept in $DATA_DIR (database, backups), owned by the system user toko."
say "to delete it too: rm -rf $DATA_DIR && userdel toko"
