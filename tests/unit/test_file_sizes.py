"""No module of the daemon or the client grows past 400 lines: past that, a module holds more than
one job and a reader loses its thread (split it by what its parts own)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 400


def test_no_module_of_the_daemon_or_the_client_is_over_400_lines():
    over = {
        str(p.relative_to(ROOT)): n
        for folder in ("tierd", "client")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > LIMIT
    }
    assert not over, f"split these modules: {over}"
