"""The code blocks of the README and the guides in ``docs/``, and what a test does with each.

A block's directive is an HTML comment on the line right above its fence (invisible on GitHub and
on the site)::

    <!-- test: setup=tiny-model -->          Python: run with the named setups first (``docs_setups.py``)
    <!-- test: setup=group ranks=2 -->       ... in 2 processes, torch.distributed's variables set
    <!-- test: run slow -->                  shell: run as shown (an install before ``&&`` is skipped)
    <!-- test: covered tests/test_x.py::test_y -->   shell: that test runs this command
    <!-- test: transcript NAME -->            console output a test compares with what the code prints now
    <!-- test: needs a cluster -->            not run here: says why (a cluster, a GPU, shared storage)

A Python block with no directive runs as written; a shell block with none fails the docs test
(say how it is checked). ``slow`` puts a block in the slow tier.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)
DIRECTIVE = re.compile(r"<!--\s*test:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    file: str  # relative to the repository
    line: int  # the fence's line, 1-based
    lang: str  # "python", "bash", "" ...
    code: str
    directive: str  # "" when none

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def slow(self) -> bool:
        return bool(re.search(r"\bslow\b", self.directive))

    @property
    def setups(self) -> list[str]:
        m = re.search(r"setup=([\w,-]+)", self.directive)
        return m.group(1).split(",") if m else []

    @property
    def ranks(self) -> int:
        m = re.search(r"ranks=(\d+)", self.directive)
        return int(m.group(1)) if m else 1

    @property
    def needs(self) -> str | None:
        m = re.match(r"needs (.+)", self.directive)
        return m.group(1) if m else None


def doc_files() -> list[Path]:
    """The README and every guide (benchmark results, under ``docs/results``, are not guides)."""
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)


def blocks(files: list[Path] | None = None) -> list[Block]:
    out = []
    for path in files or doc_files():
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            d = DIRECTIVE.match(above.strip())
            code = textwrap.dedent(m.group(3))
            out.append(Block(str(path.relative_to(ROOT)), line, m.group(2), code, d.group(1) if d else ""))
    return out


NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?%?")


def shape(line: str) -> str:
    """A console line with what varies from run to run masked: paths, quoted names, numbers, and
    the run of spaces that aligns columns."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # Ray's colors
    line = re.sub(r"(?<![\w.])/[\w./\-:]+", "<path>", line)
    line = re.sub(r"'[^']*'", "'<name>'", line)
    line = re.sub(r"\[[#.]+\]", "[<bar>]", line)
    line = NUMBER.sub("<n>", line)
    return re.sub(r"\s+", " ", line).strip()


SOURCE = re.compile(r"^\s*(?:\x1b\[[0-9;]*m)?\((?:(\w+) )?pid=\d+[^)]*\)")


def source(line: str) -> str:
    """Which process printed a console line: the actor Ray names in its prefix
    (``(RayTrainWorker pid=7) ...``), ``"pid"`` for an unnamed Ray process, ``""`` for the driver."""
    m = SOURCE.match(line)
    return "" if m is None else (m.group(1) or "pid")


def missing_lines(transcript: str, output: str, joined: bool = False) -> list[str]:
    """The transcript's lines (other than ``...``) whose shape is not in ``output``, in order;
    ``joined``: the transcript is one message wrapped over several lines.

    Order is kept within each process's lines only: Ray streams workers' lines to the driver's
    stderr asynchronously, so they may come after the driver's own summary on stdout.
    """
    if joined:
        return [] if shape(" ".join(transcript.split())) in shape(" ".join(output.split())) else [transcript]
    have: dict[str, list[str]] = {}
    for line in output.splitlines():
        have.setdefault(source(line), []).append(shape(line))
    missing, at = [], {}
    for line in transcript.splitlines():
        if not line.strip() or line.strip() == "..." or line.startswith("$ "):
            continue
        key, want = source(line), shape(line)
        try:
            at[key] = have.get(key, []).index(want, at.get(key, 0)) + 1
        except ValueError:
            missing.append(line)
    return missing
