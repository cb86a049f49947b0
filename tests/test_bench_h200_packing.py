"""``bench/h200.sh`` packs each stage's files as the stage ends: a device call cut by its limit returns
8 files, top-level ones first, and session 50 lost a compile's report and plan.json that way."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "h200.sh"


def _names(archive: Path) -> set[str]:
    with tarfile.open(archive) as t:
        return {m.name.removeprefix("./") for m in t.getmembers() if m.isfile()}


def test_each_stage_leaves_an_archive_of_its_files_and_the_files_for_later_stages(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = ('source "$1"; stage first 20 bash -c "mkdir -p $OUT/compile-x && echo plan > $OUT/compile-x/plan.json"; '
           'stage second 20 bash -c "cp $OUT/compile-x/plan.json $OUT/second.json"')
    subprocess.run(["bash", "-c", run, "h200", str(SCRIPT)], env={"OUT": str(out), "PATH": "/usr/bin:/bin"},
                   check=True, capture_output=True)
    assert _names(out / "stage-first.tgz") == {"first.log", "compile-x/plan.json"}
    assert _names(out / "stage-second.tgz") == {"second.log", "second.json"}  # only what it wrote
    assert (out / "compile-x" / "plan.json").exists() and (out / "second.json").read_text() == "plan\n"


def test_the_final_pack_holds_every_file_once_and_drops_the_stage_archives(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu.txt").write_text("H100\n")
    env = {"OUT": str(out), "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", "-c", 'source "$1"; stage first 20 bash -c "echo x > $OUT/x.json"', "h200", str(SCRIPT)],
                   env=env, check=True, capture_output=True)
    assert (out / "stage-first.tgz").exists()
    subprocess.run(["bash", str(SCRIPT), "no-such-stage"], env=env, check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz"]
    assert _names(out / "results.tgz") == {"gpu.txt", "first.log", "x.json"}
