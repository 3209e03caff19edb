"""toko-recap as an admin runs it: a wrong TOKO_DATABASE fails, it creates nothing."""

from __future__ import annotations

from pathlib import Path

from tests.operability.cli import run


async def test_recap_refuses_a_database_that_does_not_exist(tmp_path: Path) -> None:
    database = tmp_path / "var" / "toko.db"
    result = await run("toko-recap", env={"TOKO_DATABASE": str(database)})
    assert result.returncode == 1, result
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"toko-recap: no database at {database} ") and "TOKO_DATABASE" in line
    # Creating it would have recorded a recap of 0 products that toko-api never sends.
    assert not database.parent.exists()
