"""The repository stands on its own: no file points to a path or document outside it.

Code, tests, benchmarks and docs must not name an absolute path of the machine
they were written on, a sibling checkout of notes, or documents the repository
does not hold (the notes' findings and spec files, numbered sections of the
design documents). Data the tests need lives in tests/data with its source noted.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCOPE = ("pdserve/", "tests/", "benchmarks/", "docs/", "README.md", "Makefile")
# Spelled in pieces, so that this file does not name what it forbids.
_NOTES = "sha" + "red"
FORBIDDEN = re.compile(
    "|".join(
        [
            "/" + "wo" + "rk/",  # the development machine's checkout root
            r"\.\./" + _NOTES,  # the sibling notes checkout
            _NOTES + "/FIND" + "INGS",
            _NOTES + "/SP" + "EC",  # documents kept there
            r"\bFIND" + r"INGS\.md",  # ... also named without their folder
            r"\bSP" + r"EC\.md",
            "se" + "ed 00[03] \u00a7",  # numbered sections of the design documents
        ]
    )
)


def _repo_files() -> list[Path]:
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args, "--", *SCOPE], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.splitlines()

    names = set(git("ls-files")) | set(git("ls-files", "--others", "--exclude-standard"))
    return [ROOT / n for n in sorted(names) if (ROOT / n).is_file()]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (images)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_file_points_outside_the_repository():
    hits = []
    for path in _repo_files():
        text = _text(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} line(s) point outside the repository:\n" + "\n".join(hits)


def test_trace_sample_is_in_the_repository():
    from tests.data import MOONCAKE_SAMPLE

    sample = Path(MOONCAKE_SAMPLE)
    assert sample.is_file() and sample.stat().st_size < 100_000
    assert "Apache" in (sample.parent / "README.md").read_text()
