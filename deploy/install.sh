#!/bin/sh
# Install or upgrade toko as systemd services on Debian 12 or later:
#   sudo make install        (from a checkout)
# Installs the build packages it needs, the system user toko, a virtualenv in
# /opt/toko/venv with this checkout, the units (and the sandbox they share,
# toko-.service.d/00-hardening.conf), /etc/toko/toko.env and the API
# token /etc/toko/api-token (both only when missing, or the token when empty;
# synced to disk), and on the first install enables and starts toko-api.socket,
# toko-api.service and both timers. Running it again upgrades in place, keeps
# the data in /var/lib/toko and each unit enabled, disabled or masked as the
# admin left it.
set -eu
# A root shell from a plain `su` (no dash) keeps the user's PATH, which lacks
# the sbin directories where useradd is.
PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin
export PATH

PREFIX=/opt/toko
VENV=$PREFIX/venv
UNIT_DIR=/usr/local/lib/systemd/system # the local admin's vendor dir: /etc stays for overrides
CONF_DIR=/etc/toko
USER_NAME=toko
# Build needs of systemd-python (libsystemd-dev, pkg-config, a C compiler, the
# Python headers) and the venv module; the same list as the Makefile's APT_BUILD.
APT_PACKAGES="python3-venv python3-dev libsystemd-dev pkg-config gcc"
UNITS="toko-api.socket toko-api.service toko-recap.service toko-recap.timer toko-backup.service toko-backup.timer toko-alert@.service"
ENABLED="toko-api.socket toko-api.service toko-recap.timer toko-backup.timer"
# The sandbox of every toko-*.service, one drop-in for all (the file says why).
# Installed before the units: an upgrade never has new units without it.
DROP_INS="toko-.service.d/00-hardening.conf"
# Present from the first install until its units are enabled (see below).
ENABLE_PENDING=$PREFIX/enable-units

say() { echo "toko install: $*"; }
die() {
    echo "toko install: error: $*" >&2
    exit 1
}

[ "$(id -u)" -eq 0 ] || die "run as root: sudo make install"
SRC=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$SRC/pyproject.toml" ] || die "no pyproject.toml in $SRC: run from a toko checkout"

missing=""
for pkg in $APT_PACKAGES; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
        missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    say "installing Debian packages:$missing"
    apt-get update -qq
    # shellcheck disable=SC2086 # one word a package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
else
    say "Debian packages present"
fi

if getent passwd "$USER_NAME" >/dev/null; then
    say "system user $USER_NAME exists"
else
    say "creating system user $USER_NAME"
    # Home is the state directory, so `sudo -u toko sqlite3 toko.db` works from it.
    useradd --system --user-group --home-dir /var/lib/toko --no-create-home \
        --shell /usr/sbin/nologin --comment "toko product API" "$USER_NAME"
fi

# A venv from another Python (e.g. after a Debian upgrade) cannot be repaired: rebuild it.
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c "" 2>/dev/null; then
    say "virtualenv $VENV is broken, recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV"
    install -d -m 0755 "$PREFIX"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip
fi

# Build from a clean copy so root leaves no build/ or *.egg-info in the checkout.
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
tar -C "$SRC" --exclude=./.git --exclude=./.venv --exclude=./var --exclude=./build \
    --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$BUILD" -xf -
say "installing toko from $SRC into $VENV"
# pip always reinstalls a package given as a directory: new code even when the
# version number did not change.
"$VENV/bin/pip" install -q --disable-pip-version-check "$BUILD"
install -m 0644 "$SRC/README.md" "$PREFIX/README.md"
# The current settings with their comments, to compare a kept toko.env with.
install -m 0644 "$SRC/deploy/toko.env.example" "$PREFIX/toko.env.example"
for cmd in toko-api toko-recap toko-backup toko-alert; do
    [ -x "$VENV/bin/$cmd" ] || say "warning: $VENV/bin/$cmd is missing from the package"
done

install -d -m 0755 "$UNIT_DIR"
# Only the first install enables the units; an upgrade leaves each one as the
# admin set it (the multi-host setup disables toko-backup.timer on all hosts
# but one, and enabling a masked unit fails). No units here yet means a first
# install, or one after an uninstall. It leaves a note, removed once the units
# are enabled, so that a first install stopped before that (or run without
# systemd) still enables them the next time, not taken for an upgrade.
if [ ! -e "$UNIT_DIR/toko-api.service" ]; then
    : >"$ENABLE_PENDING"
fi
changed=""
for unit in $DROP_INS $UNITS; do
    if ! cmp -s "$SRC/deploy/systemd/$unit" "$UNIT_DIR/$unit"; then
        install -d -m 0755 "$(dirname "$UNIT_DIR/$unit")"
        install -m 0644 "$SRC/deploy/systemd/$unit" "$UNIT_DIR/$unit"
        changed="$changed $unit"
    fi
done
say "units in $UNIT_DIR${changed:+, changed:$changed}"

install -d -m 0750 -o root -g "$USER_NAME" "$CONF_DIR"
if [ -e "$CONF_DIR/toko.env" ]; then
    say "keeping $CONF_DIR/toko.env (all settings, commented: $PREFIX/toko.env.example)"
else
    say "writing $CONF_DIR/toko.env (edit it, then: systemctl restart toko-api)"
    install -m 0640 -o root -g "$USER_NAME" "$SRC/deploy/toko.env.example" "$CONF_DIR/toko.env"
    sync "$CONF_DIR/toko.env" "$CONF_DIR"
fi

# The write token: toko-api gets it as a credential (LoadCredential=), the
# service user cannot read the file. Created once; upgrades keep it. An empty
# one, which toko-api refuses, is what a power cut during the first install can
# leave: replace it rather than keep a service that cannot start.
if [ -s "$CONF_DIR/api-token" ]; then
    say "keeping the API token $CONF_DIR/api-token"
else
    [ ! -e "$CONF_DIR/api-token" ] || say "the API token $CONF_DIR/api-token is empty"
    say "writing a new API token to $CONF_DIR/api-token (clients send it as: Authorization: Bearer <token>)"
    (
        umask 077
        head -c 32 /dev/urandom | base64 | tr -d '+/=\n' >"$CONF_DIR/api-token.new"
    )
    # On disk before it gets its name, and the new name on disk after.
    sync "$CONF_DIR/api-token.new"
    mv "$CONF_DIR/api-token.new" "$CONF_DIR/api-token"
    sync "$CONF_DIR"
fi

if [ ! -d /run/systemd/system ]; then
    say "systemd is not running here: units installed; run this again under systemd to enable and start them"
    exit 0
fi
systemctl daemon-reload
first=""
if [ -e "$ENABLE_PENDING" ]; then
    say "enabling $ENABLED"
    # shellcheck disable=SC2086 # one word a unit
    systemctl enable --quiet $ENABLED
    rm -f "$ENABLE_PENDING"
    first=yes
fi
# A changed socket must be re-created to listen elsewhere; that alone drops the
# connections waiting in its queue, so leave an unchanged one alone.
case "$changed" in *toko-api.socket*)
    if systemctl is-active --quiet toko-api.socket; then
        say "restarting toko-api.socket (its unit changed)"
        systemctl stop toko-api.service toko-api.socket
    fi
    ;;
esac
# An upgrade is often the fix for a crash loop: clear a start limit it hit.
systemctl reset-failed toko-api.socket toko-api.service 2>/dev/null || true
systemctl start toko-api.socket
if systemctl is-active --quiet toko-api.service; then
    say "restarting toko-api.service (the socket keeps accepting meanwhile)"
    systemctl restart toko-api.service
else
    say "starting toko-api.service"
    systemctl start toko-api.service
fi
# Restarting a timer recomputes its next run from a changed schedule. On an
# upgrade only a running one: a timer the admin stopped stays stopped.
if [ -n "$first" ]; then
    systemctl restart toko-recap.timer toko-backup.timer
else
    systemctl try-restart toko-recap.timer toko-backup.timer
fi

say "done. toko-api listens on: $(systemctl show -P Listen toko-api.socket)"
say "check it with: systemctl status toko-api; systemctl list-timers 'toko-*'; journalctl -u toko-api"
