"""The Debian package itself: install, upgrade, conffiles, remove, purge, take-over, lintian.

They share the session's machine with the other system tests and run in file
order. Those that need toko as the session installed it take the ``toko``
fixture (it reinstalls the current package if an earlier test left another
or none); the others set up the state they start from themselves, and the
``toko`` fixture of whichever test comes next puts the current package back.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.system.deployment import (
    COMMANDS,
    CONF_DIR,
    DATA_DIR,
    DATABASE,
    DEB_DIR,
    ENABLED_UNITS,
    ENV_FILE,
    HARDENING_DROP_IN,
    INSTALLED_UNITS,
    MAN_PAGES,
    PACKAGE,
    TOKEN_FILE,
    UNIT_DIR,
    VENV,
    VENV_PYTHON,
    Deployment,
    posting_meanwhile,
)
from tests.system.machine import log, wait_until
from tests.system.packages import CHANGED_LINE, SuitePackages, deb_field, lintian_of

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

TIMERS = ("toko-recap.timer", "toko-backup.timer")
# Root's PATH in a plain `su` (no dash): the user's, login.defs' ENV_PATH.
USER_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
CONFOLD = ("-o", "Dpkg::Options::=--force-confold")


def mode(toko: Deployment, path: str) -> list[str]:
    return toko.machine.run(["stat", "-c", "%a %U %G", path]).stdout.split()


def exists(toko: Deployment, path: str) -> bool:
    return toko.machine.run(["test", "-e", path], check=False).returncode == 0


def has_user(toko: Deployment, name: str = "toko") -> bool:
    return toko.machine.run(["getent", "passwd", name], check=False).returncode == 0


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def timer_states(toko: Deployment) -> dict[str, tuple[str, str]]:
    return {t: (toko.show(t, "UnitFileState"), toko.show(t, "ActiveState")) for t in TIMERS}


def test_installed_package_serves_with_its_commands_and_man_pages(toko: Deployment) -> None:
    current = toko.packages.current.result()
    assert toko.status() == "ii"
    assert toko.version() == deb_field(current, "Version")
    # Enabled and started by the install, from the package's units.
    for unit in ("toko-api.socket", "toko-api.service", *TIMERS):
        assert toko.show(unit, "UnitFileState") == "enabled", unit
        assert toko.show(unit, "ActiveState") == "active", unit
    for unit in INSTALLED_UNITS:
        loaded = unit.replace("@.", "@test.")  # the template, as an instance loads it
        assert toko.fragment(loaded) == f"{UNIT_DIR}/{unit}", unit
    assert toko.post_product("Dari paket", 5000)["nama"] == "Dari paket"
    wait_until(lambda: toko.timers_scheduled(*TIMERS), 60, "both timers listed with a next run")

    found = toko.machine.sh("for c in " + " ".join(COMMANDS) + "; do command -v $c; done")
    assert found.stdout.split() == [f"/usr/bin/{c}" for c in COMMANDS]
    stats = toko.machine.run(["runuser", "-u", "toko", "--", "toko-queue", "stats"])
    assert "pending" in stats.stdout, stats

    # man-db is there (the session installed it, as a server has it).
    pages = toko.machine.run(["man", "-w", "toko-api", "toko.env"]).stdout.split()
    assert pages == ["/usr/share/man/man8/toko-api.8.gz", "/usr/share/man/man5/toko.env.5.gz"]
    listed = toko.machine.run(["dpkg", "-L", PACKAGE]).stdout.splitlines()
    assert {f"/usr/share/man/{page}.gz" for page in MAN_PAGES} <= set(listed), listed
    shown = toko.machine.run(["env", "MANWIDTH=100", "man", "-P", "cat", "8", "toko-api"])
    assert "--check-config" in shown.stdout, shown.stdout[:2000]

    conffiles = toko.machine.run(["dpkg-query", "-W", "-f=${Conffiles}", PACKAGE]).stdout
    assert ENV_FILE in conffiles.split(), conffiles
    assert mode(toko, CONF_DIR) == ["750", "root", "toko"]
    assert mode(toko, ENV_FILE) == ["640", "root", "toko"]
    assert mode(toko, TOKEN_FILE) == ["600", "root", "root"]
    assert mode(toko, DATA_DIR) == ["700", "toko", "toko"]
    toko.machine.run([VENV_PYTHON, "-c", "import service, jobs"])
    # What a server needs no more: no compiler, no -dev package.
    assert toko.machine.sh("command -v gcc || command -v cc", check=False).stdout == ""
    packages = toko.machine.run(["dpkg-query", "-W", "-f=${Package}\n"]).stdout.split()
    assert [p for p in packages if p.endswith("-dev")] == []
    log(
        f"{toko.machine.suite}: {current.name}: {current.stat().st_size} bytes;"
        f" Depends: {deb_field(current, 'Depends')}"
    )


# toko-api's own line, as postinst quotes it. Taken from the journal, this
# line went missing in 6 starts of 100: the journal can get the line of a
# process that exits at once without its invocation ID.
NAMED = "\n  toko-api: TOKO_WORKERS must be an integer from 1 to 256, got 'abc'\n"


def test_bad_setting_leaves_the_package_installed_and_names_the_variable(
    toko: Deployment,
) -> None:
    current = toko.packages.current.result()
    products = toko.sql("SELECT count(*) FROM products")[0][0]
    with toko.settings_added("TOKO_WORKERS=abc"):
        # On an upgrade (a reinstall runs the same maintainer scripts)...
        upgrade = toko.install(current, "--reinstall", check=False)
        assert upgrade.returncode == 0 and toko.status() == "ii", output(upgrade)
        assert NAMED in output(upgrade), output(upgrade)
        assert toko.show("toko-api.service", "ActiveState") != "active"
        # ...and on an install over the configuration a remove kept.
        toko.apt("remove", "-y", PACKAGE)
        assert toko.status() == "rc"
        install = toko.install(current, check=False)
        assert install.returncode == 0 and toko.status() == "ii", output(install)
        assert NAMED in output(install), output(install)
        assert toko.show("toko-api.service", "ActiveState") != "active"
        # The install after the remove enabled the units again.
        for unit in ENABLED_UNITS:
            assert toko.show(unit, "UnitFileState") == "enabled", unit
    toko.ensure_running()
    # The data the remove kept is the shop's again.
    assert toko.sql("SELECT count(*) FROM products")[0][0] == products
    assert toko.post_product("Setelah setelan diperbaiki")["id"] > 0


# -- remove and purge ------------------------------------------------------------

# Not the package's and not its data, kept by remove and purge alike: the
# admin's drop-ins (this session's port among them; earlier tests leave their
# folders), and systemd's record of the timers' last runs (Persistent=true),
# which is systemd's and not dpkg's.
NOBODYS = (
    r"/etc/systemd/system/toko-[a-z@.-]*\.d(/.*)?",
    r"/var/lib/systemd/timers/stamp-toko-[a-z]+\.timer",
    # The mailbox of the user toko, which stays (the Postfix test mails it).
    r"/var/mail/toko",
)
# debhelper's own record of what was enabled, kept by a remove so that the
# next install enables the same units again (and not one the admin disabled);
# a purge removes it.
ENABLED_RECORD = (
    r"/etc/systemd/system/[a-z.-]+\.wants/toko-[a-z]+\.(service|socket|timer)",
    r"/var/lib/systemd/deb-systemd-helper-enabled/.*toko-[a-z]+\.(service|socket|timer).*",
)


def toko_paths(toko: Deployment) -> list[str]:
    """Every path with toko in it, but in what is no package's business
    (/proc, /run, /tmp, the journal, root's home with the .deb files), dpkg's
    and apt's own records and the tree's stamp."""
    prune = ["/proc", "/sys", "/dev", "/run", "/tmp", "/var/tmp", DEB_DIR, "/var/log/journal"]
    prune += ["/var/lib/dpkg", "/var/lib/apt", "/var/cache/apt", "/var/cache/man"]
    expr = " -o ".join(f"-path {p}" for p in prune)
    found = toko.machine.sh(f"find / -xdev \\( {expr} \\) -prune -o -path '*toko*' -print")
    return sorted(p for p in found.stdout.split() if p != "/.toko-systest-recipe")


def unexpected(paths: list[str], *allowed: str) -> list[str]:
    return [p for p in paths if not any(re.fullmatch(pattern, p) for pattern in allowed)]


def test_remove_keeps_configuration_and_data_and_purge_removes_them(toko: Deployment) -> None:
    # What debian/README.Debian says: remove keeps /etc/toko (toko.env, the
    # API token) and /var/lib/toko; purge removes both; the user toko stays.
    products = toko.sql("SELECT count(*) FROM products")[0][0]
    assert products > 0
    token = toko.token
    toko.machine.sh(f"echo '# the admin was here' >> {ENV_FILE}")
    edited = toko.machine.run(["cat", ENV_FILE]).stdout

    removed = toko.apt("remove", "-y", PACKAGE)
    assert toko.status() == "rc", output(removed)
    left = toko_paths(toko)
    kept = (re.escape(p) for p in (CONF_DIR, ENV_FILE, TOKEN_FILE))
    assert unexpected(left, *kept, re.escape(DATA_DIR) + "(/.*)?", *ENABLED_RECORD, *NOBODYS) == []
    assert {ENV_FILE, TOKEN_FILE, DATABASE} <= set(left), left
    assert toko.machine.run(["cat", ENV_FILE]).stdout == edited
    assert toko.machine.run(["cat", TOKEN_FILE]).stdout.strip() == token
    assert has_user(toko)
    # The folders toko's files were in stay for others (dpkg removes one the
    # package was the only one to ship, /opt on a server without another).
    for folder in ("/opt", "/usr/lib/systemd/system", "/etc/systemd/system"):
        assert exists(toko, folder), folder
    # Nothing of toko's runs, or is known to systemd, any more.
    units = toko.machine.sh(
        "systemctl list-units --all --no-legend --plain 'toko-*'"
        " --state=active,activating,deactivating,failed;"
        " systemctl list-unit-files --no-legend --plain 'toko-*'",
        check=False,  # list-unit-files exits 1 when it lists nothing
    ).stdout
    assert units.strip() == "", units
    log(f"{toko.machine.suite}: after apt-get remove: {left}")

    purged = toko.apt("purge", "-y", PACKAGE)
    assert toko.status() == "un", output(purged)
    left = toko_paths(toko)
    assert unexpected(left, *NOBODYS) == [], left
    assert has_user(toko)
    assert exists(toko, "/opt")
    overrides = toko.machine.run(["dpkg-statoverride", "--list"]).stdout
    assert "toko" not in overrides, overrides
    log(f"{toko.machine.suite}: after apt-get purge: {left}")


# -- upgrades --------------------------------------------------------------------


def test_upgrade_from_a_lower_version_keeps_state_and_the_socket_answers(
    deployment: Deployment,
) -> None:
    toko = deployment
    lower, current = toko.packages.lower.result(), toko.packages.current.result()
    if toko.status() != "un":
        toko.apt("purge", "-y", PACKAGE)
    # A server that never had toko: no user either (purge keeps it).
    toko.machine.run(["userdel", "toko"], check=False)
    # The first install from the root shell of a plain `su`, without /usr/sbin
    # on the PATH (a Debian installed with a root password has no sudo): the
    # user is made all the same (useradd, in /usr/sbin, was not found once).
    first = toko.machine.run(
        [
            "env",
            f"PATH={USER_PATH}",
            "DEBIAN_FRONTEND=noninteractive",
            "su",
            "-c",
            f"apt-get install -y {toko.deb_path(lower)}",
        ],
        check=False,
        timeout=600,
    )
    assert first.returncode == 0 and toko.status() == "ii", output(first)
    assert toko.version() == deb_field(lower, "Version")
    assert has_user(toko)
    toko.read_token()
    toko.wait_serving()
    before = [toko.post_product(f"Sebelum upgrade {i}")["id"] for i in range(3)]
    # The admin's changes: a setting, a timer turned off on this host (the
    # multi-host setup), another masked.
    toko.machine.sh(f"printf 'TOKO_WORKERS=4\\n# kept by the upgrade\\n' >> {ENV_FILE}")
    edited = toko.machine.run(["cat", ENV_FILE]).stdout
    toko.machine.run(["systemctl", "disable", "--now", "toko-backup.timer"])
    toko.machine.run(["systemctl", "mask", "--now", "toko-recap.timer"])
    timers = timer_states(toko)
    token, pid = toko.token, toko.main_pid()
    try:
        with posting_meanwhile(toko, "Selama upgrade", clients=1) as traffic:
            began = time.monotonic()
            upgrade = toko.install(current)
            ended = time.monotonic()
            toko.wait_serving(old_pid=pid)
        assert traffic.failures == [], traffic.failures[:10]
        during = traffic.sent_between(began, ended)
        assert during, "no request was sent during the upgrade"
        log(
            f"{toko.machine.suite}: upgrade {lower.name} -> {current.name} took"
            f" {ended - began:.1f} s; {len(during)} products created meanwhile, none refused"
        )
        assert toko.status() == "ii" and toko.version() == deb_field(current, "Version")
        stored = {row[0] for row in toko.sql("SELECT id FROM products")}
        assert {*before, *(product for _, product in traffic.created)} <= stored
        assert toko.machine.run(["cat", TOKEN_FILE]).stdout.strip() == token
        assert toko.machine.run(["cat", ENV_FILE]).stdout == edited, output(upgrade)
        assert mode(toko, ENV_FILE) == ["640", "root", "toko"]
        # The package's toko.env did not change: nothing to ask, nothing beside it.
        assert toko.machine.sh(f"ls {CONF_DIR}").stdout.split() == ["api-token", "toko.env"]
        after = timer_states(toko)
        assert after == timers, output(upgrade)
        assert after["toko-backup.timer"] == ("disabled", "inactive")
        # `mask --now` itself leaves the timer failed, before any upgrade.
        assert after["toko-recap.timer"] in (("masked", "inactive"), ("masked", "failed"))
        assert toko.show("toko-api.socket", "UnitFileState") == "enabled"
        assert toko.post_product("Setelah upgrade")["id"] > max(before)
    finally:
        toko.machine.run(["systemctl", "unmask", "toko-recap.timer"])
        toko.machine.run(["systemctl", "reset-failed", "toko-recap.timer"], check=False)
        toko.machine.run(["systemctl", "enable", "--now", *TIMERS], check=False)


def test_an_edited_toko_env_is_never_overwritten_by_a_changed_one(toko: Deployment) -> None:
    first, second = toko.packages.changed.result()
    toko.machine.sh(f"echo 'TOKO_WORKERS=4' >> {ENV_FILE}")
    edited = toko.machine.run(["cat", ENV_FILE]).stdout
    dist, new = f"{ENV_FILE}.dpkg-dist", f"{ENV_FILE}.dpkg-new"

    # Told to keep the admin's: kept, the package's beside it.
    kept = toko.install(first, *CONFOLD)
    assert toko.status() == "ii" and toko.version() == deb_field(first, "Version")
    assert "Using current old file as you requested" in output(kept), output(kept)
    assert toko.machine.run(["cat", ENV_FILE]).stdout == edited
    shipped = toko.machine.run(["cat", dist]).stdout
    assert CHANGED_LINE.format(version=deb_field(first, "Version")) in shipped
    assert "TOKO_WORKERS=4" not in shipped
    toko.machine.run(["rm", dist])

    # Told nothing, with no terminal to ask on: dpkg stops at its question
    # and leaves the admin's file as it was.
    asked = toko.install(second, check=False)
    assert asked.returncode != 0, output(asked)
    assert "conffile prompt" in output(asked), output(asked)
    assert toko.status() != "ii"
    assert toko.machine.run(["cat", ENV_FILE]).stdout == edited
    assert exists(toko, new)
    # The admin's answer: keep mine.
    toko.machine.run(["dpkg", "--force-confold", "--configure", PACKAGE], timeout=300)
    assert toko.status() == "ii" and toko.version() == deb_field(second, "Version")
    assert toko.machine.run(["cat", ENV_FILE]).stdout == edited
    assert not exists(toko, new)
    shipped = toko.machine.run(["cat", dist]).stdout
    assert CHANGED_LINE.format(version=deb_field(second, "Version")) in shipped
    toko.wait_serving()
    assert toko.post_product("Setelan tetap")["id"] > 0


# -- take-over from `make install` ---------------------------------------------

OLD_PREFIX = "/opt/toko"
OLD_UNIT_DIR = "/usr/local/lib/systemd/system"
# What the last `make install` (409b72a) installed, kept beside this file.
OLD_FILES = Path(__file__).with_name("old_install")


def old_file(path: str) -> str:
    """A file as the last `make install` installed it (deploy/... in 409b72a)."""
    return (OLD_FILES / path.removeprefix("deploy/")).read_text()


def set_up_make_install_layout(toko: Deployment) -> None:
    """What `make install` left on a server, set up as deploy/install.sh did,
    toko-api running from it.

    Its venv is the package's, moved to /opt/toko/venv with its scripts' first
    lines changed to match: the code the old installer would have put there.
    """
    m = toko.machine
    m.run(["cp", "-a", VENV, "/root/old-venv"])
    toko.apt("purge", "-y", PACKAGE)
    m.sh(
        f"install -d -m 0755 {OLD_PREFIX} && mv /root/old-venv {OLD_PREFIX}/venv"
        f" && for f in {OLD_PREFIX}/venv/bin/*; do"
        f' [ -L "$f" ] || ! head -c 2 "$f" | grep -q \'#!\''
        f" || sed -i '1s|^#!{VENV}/|#!{OLD_PREFIX}/venv/|' \"$f\"; done"
    )
    m.write(f"{OLD_PREFIX}/README.md", old_file("README.md"))
    m.write(f"{OLD_PREFIX}/toko.env.example", old_file("deploy/toko.env.example"))
    for unit in (*INSTALLED_UNITS, HARDENING_DROP_IN):
        m.write(f"{OLD_UNIT_DIR}/{unit}", old_file(f"deploy/systemd/{unit}"))
    if not has_user(toko):
        # As deploy/install.sh made it.
        home = ["--home-dir", DATA_DIR, "--no-create-home", "--shell", "/usr/sbin/nologin"]
        m.run(
            ["useradd", "--system", "--user-group", *home, "--comment", "toko product API", "toko"]
        )
    m.run(["install", "-d", "-m", "0750", "-o", "root", "-g", "toko", CONF_DIR])
    m.write(ENV_FILE, old_file("deploy/toko.env.example") + "TOKO_WORKERS=4\n", mode=0o640)
    m.run(["chown", "root:toko", ENV_FILE])
    m.sh(f"umask 077; head -c 32 /dev/urandom | base64 | tr -d '+/=\\n' > {TOKEN_FILE}")
    m.run(["systemctl", "daemon-reload"])
    m.run(["systemctl", "enable", "--quiet", *ENABLED_UNITS])
    m.run(["systemctl", "start", "toko-api.socket", "toko-api.service", *TIMERS])
    # This host is not the one that backs up (the multi-host setup).
    m.run(["systemctl", "disable", "--now", "toko-backup.timer"])


def test_the_package_takes_over_from_the_make_install_layout(deployment: Deployment) -> None:
    toko = deployment
    current = toko.packages.current.result()
    if toko.status() != "ii":
        toko.install(current)
    set_up_make_install_layout(toko)
    toko.read_token()
    toko.wait_serving()
    assert toko.fragment("toko-api.service") == f"{OLD_UNIT_DIR}/toko-api.service"
    made = [toko.post_product(f"Dari make install {i}")["id"] for i in range(3)]
    env, token = toko.machine.run(["cat", ENV_FILE]).stdout, toko.token

    try:
        taken = toko.install(current)
        toko.wait_serving()
        assert toko.status() == "ii", output(taken)
        for unit in INSTALLED_UNITS:
            loaded = unit.replace("@.", "@test.")  # the template, as an instance loads it
            assert toko.fragment(loaded) == f"{UNIT_DIR}/{unit}", unit
            drop_ins = toko.drop_ins(loaded)
            assert all(not p.startswith(OLD_UNIT_DIR) for p in drop_ins), (unit, drop_ins)
            if unit.endswith(".service"):
                assert f"{UNIT_DIR}/{HARDENING_DROP_IN}" in drop_ins, (unit, drop_ins)
        for unit in ("toko-api.socket", "toko-api.service", "toko-recap.timer"):
            assert toko.show(unit, "UnitFileState") == "enabled", unit
            assert toko.show(unit, "ActiveState") == "active", unit
        assert timer_states(toko)["toko-backup.timer"] == ("disabled", "inactive")
        main = toko.machine.run(["cat", f"/proc/{toko.main_pid()}/cmdline"]).stdout.split("\0")
        assert "/usr/bin/toko-api" in main, main
        # Nothing of the old layout is left to shadow or confuse: no unit, no
        # enable link into it, no venv.
        assert toko.machine.sh(f"ls {OLD_UNIT_DIR}").stdout.split() == []
        dangling = toko.machine.sh("find /etc/systemd/system -xtype l -name 'toko*'").stdout
        assert dangling == ""
        assert not exists(toko, OLD_PREFIX)
        # The shop's state came along.
        assert toko.machine.run(["cat", ENV_FILE]).stdout == env
        assert toko.machine.run(["cat", TOKEN_FILE]).stdout.strip() == token
        assert mode(toko, ENV_FILE) == ["640", "root", "toko"]
        stored = {row[0] for row in toko.sql("SELECT id FROM products")}
        assert set(made) <= stored
        assert toko.post_product("Dari paket setelah make install")["id"] > max(made)
    finally:
        toko.machine.run(["systemctl", "enable", "--now", "toko-backup.timer"], check=False)


# -- lintian ---------------------------------------------------------------------


def test_lintian_of_the_release_finds_no_error(
    suite: str, packages: dict[str, SuitePackages]
) -> None:
    # The build ran it in its clean tree of the release (the build fails on
    # an error); here its report, so that every warning shows in the log.
    deb = packages[suite].current.result()
    report = lintian_of(deb)
    warnings = report.tags("W")
    log(
        f"{suite}: lintian on {deb.name}: {len(warnings)} warnings"
        + "".join(f"\n  {w}" for w in warnings)
    )
    assert report.tags("E") == [], report.output


def test_piuparts_installs_upgrades_and_purges_cleanly(
    suite: str, packages: dict[str, SuitePackages]
) -> None:
    # Run in the background since the builds (tests/system/packages.py).
    result = packages[suite].piuparts.result()
    log(f"{suite}: piuparts:" + "".join(f"\n  {line}" for line in result.verdict))
    assert result.returncode == 0, "\n".join(result.output.splitlines()[-80:])
    assert any("PASS: Installation, upgrade and purging tests." in v for v in result.verdict)
    assert any("PASS: All tests." in v for v in result.verdict), result.verdict
