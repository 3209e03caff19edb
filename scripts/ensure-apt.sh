#!/bin/sh
# Install the Debian packages named as arguments, but only those missing, so a
# prepared machine needs neither root nor the network.
set -eu
missing=""
for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $pkg"
    fi
done
[ -z "$missing" ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    # A Debian installed with a root password has no sudo: say what root must do.
    if ! command -v sudo >/dev/null 2>&1; then
        echo "missing Debian packages:$missing; without sudo, install them as root" \
            "(su -, then: apt-get install$missing) and run make again" >&2
        exit 1
    fi
    SUDO="sudo"
fi
echo "Installing Debian packages:$missing"
$SUDO apt-get update -qq
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
