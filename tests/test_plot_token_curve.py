"""experiments/plot_token_curve.py: a plot from evaluation JSON, and one-line errors for a bad series."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "plot_token_curve.py"


def _eval(path: Path, kl: float) -> str:
    buckets = {b: {"kl_mean": kl, "kl_p99": 10 * kl} for b in ("en", "zh", "code")}  # no news: drawn without it
    path.write_text(json.dumps({"buckets": buckets}))
    return str(path)


def test_plot_and_table(tmp_path):
    a, b = _eval(tmp_path / "a.json", 0.5), _eval(tmp_path / "b.json", 0.4)
    out = tmp_path / "curve.png"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), f"qat=200:{b},100:{a}"],
                       capture_output=True, text=True, check=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp.png"))
    lines = r.stdout.splitlines()  # in token order, whatever order they were given in
    assert lines[0].startswith("qat | 100 | en 0.500 / 5.00") and lines[1].startswith("qat | 200 | en 0.400")


def test_bad_series_is_one_line_error(tmp_path):
    out = tmp_path / "curve.png"
    bad = (("no-equals", "LABEL="), (f"s=abc:{tmp_path}/x.json", "TOKENS:"), ("s=5:/nonexistent.json", "does not exist"))
    for spec, word in bad:
        r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), spec], capture_output=True, text=True,
                           check=False)
        assert r.returncode != 0 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()
