"""qat.release_memory on the debug flavor: a random artifact written block by block, release and verify run
under /usr/bin/time -v, each command's peak RSS and exit status recorded (the 8B shape's run is the committed
results/release-memory/llama3.1-8b.json)."""
from __future__ import annotations

import json

import pytest

from core.errors import SmeltError
from qat.release_memory import main


def test_release_memory_records_both_commands(tmp_path):
    out = tmp_path / "m.json"
    assert main(["--flavor", "debug-untied", "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["runs"]) == {"release", "verify"} and rec["within_limit"] is True
    for run in rec["runs"].values():
        assert run["exit_status"] == 0 and 0 < run["max_rss_bytes"] < rec["limit_bytes"]
    assert "PASSED: 0 failure(s)" in rec["runs"]["verify"]["output_tail"]
    assert rec["artifact_bytes"] > 4 * rec["parameters"] and not (tmp_path / "w").exists()  # fp32; removed


def test_release_memory_refuses_a_work_directory_in_use(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "kept").write_text("a user's file")
    with pytest.raises(SmeltError, match="--workdir .* is not empty"):
        main(["--flavor", "debug", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "m.json")])
    assert (tmp_path / "w" / "kept").read_text() == "a user's file"
