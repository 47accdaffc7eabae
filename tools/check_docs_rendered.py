"""Build the docs site, open every page in a headless browser, and check what a reader sees.

    python tools/check_docs_rendered.py                 # every page; screenshots in out/docs_render/
    python tools/check_docs_rendered.py performance recovery
    python tools/check_docs_rendered.py --whole architecture   # the whole page, in 3000-pixel parts

Needs Debian's chromium (``apt-get install chromium``). For each page of the site it saves a
full-width screenshot of its top (``--whole``: of all of it, cut into parts ``NAME-1.png``,
``NAME-2.png``, ... that an image viewer shows at a readable size; needs Pillow). Look at them before
a docs change lands. It fails, naming the page, when:
- markup shows through: a literal code fence, ``**``, a table's ``|---|`` row, an HTML comment
  or a list item's ``- `` run into a paragraph, in the text the browser renders;
- a picture (a ``mermaid`` block) did not render to an SVG, or Mermaid reported a syntax error.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "docs_render"
SHOWS_THROUGH = {"a code fence": "```", "bold markup": "**", "a table's rule row": "|---", "an HTML comment": "<!--"}
# A list item that ran into the paragraph before it (a table or a paragraph nested in a list item
# without the indentation Python-Markdown needs ends the list): its "- " shows after a sentence.
RAN_IN = re.compile(r"[.;:,)]\s+-\s+\S")


class _VisibleText(HTMLParser):
    """The text a reader sees: everything but scripts, styles, code blocks and the search index."""

    HIDDEN = {"script", "style", "code", "pre", "svg", "noscript", "title"}

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.parts = 0, []

    def handle_starttag(self, tag, attrs):
        if tag in self.HIDDEN:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag in self.HIDDEN and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)


def problems(dom: str, console: str = "") -> list[str]:
    """What is wrong with one rendered page (its DOM after scripts ran, and what it logged)."""
    parser = _VisibleText()
    parser.feed(dom)
    text = " ".join(parser.parts)
    found = [f"{what} shows through: ...{_around(text, m)}..." for what, m in SHOWS_THROUGH.items() if m in text]
    ran_in = RAN_IN.search(text)
    found += [f"a list item ran into a paragraph: ...{_around(text, ran_in.group())}..."] if ran_in else []
    # The theme draws a picture into a shadow root that replaces its ``<pre class="mermaid">`` with a
    # ``<div class="mermaid">``; the dump leaves the shadow root out, so a ``pre`` left is one not drawn.
    left = dom.count('<pre class="mermaid"')
    found += [f"{left} picture(s) not drawn"] if left else []
    found += [
        f"the browser's console: {line.strip()}" for line in console.splitlines() if "rror" in line and "ermaid" in line
    ]
    return found


def _around(text: str, mark: str) -> str:
    i = text.index(mark)
    return " ".join(text[max(0, i - 60) : i + 60].split())


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _chromium(*args: str) -> tuple[str, str]:
    """The browser's stdout and its log (with the page's console messages)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("chromium not found: apt-get install chromium")
    base = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr"]
    done = subprocess.run([*base, "--virtual-time-budget=8000", *args], capture_output=True, text=True, timeout=120)
    return done.stdout, done.stderr


PART = 3000  # pixels of page per screenshot
TALLEST = 24000  # a page taller than this is cut off at the last part


def _cut(shot: Path) -> list[Path]:
    """A tall screenshot cut into parts of ``PART`` pixels, down to where the page's content ends
    (above the theme's dark footer); the parts replace ``shot``."""
    from PIL import Image

    image = Image.open(shot).convert("L")
    width, height = image.size
    column = image.crop((width // 4, 0, width * 3 // 4, height))  # the text, not the navigation
    bottom = height
    while bottom > 1 and column.getpixel((0, bottom - 1)) < 128:  # the footer
        bottom -= 1
    rows = column.crop((0, 0, column.width, bottom)).point(lambda v: 0 if v > 250 else 255).getbbox()
    end = min(bottom, (rows[3] if rows else 0) + 80)
    parts = []
    for i, top in enumerate(range(0, end, PART), start=1):
        part = shot.with_name(f"{shot.stem}-{i}.png")
        Image.open(shot).crop((0, top, width, min(top + PART, end))).save(part)
        parts.append(part)
    shot.unlink()
    return parts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pages", nargs="*", help="page names (e.g. performance, index); default: every page")
    p.add_argument("--whole", action="store_true", help="screenshot each whole page, in parts")
    a = p.parse_args()
    site = Path(tempfile.mkdtemp(prefix="hf_lowzero_site_"))
    subprocess.run(["mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)], cwd=ROOT, check=True)
    pages = sorted(site.glob("**/index.html"))
    pages = [q for q in pages if "results" not in q.relative_to(site).parts]
    OUT.mkdir(parents=True, exist_ok=True)
    server, port = _serve(site)
    failed = 0
    try:
        for page in pages:
            rel = page.parent.relative_to(site).as_posix()
            url = f"http://127.0.0.1:{port}/{rel + '/' if rel != '.' else ''}"
            name = rel.replace("/", "_") if rel != "." else "index"
            if a.pages and name not in a.pages:
                continue
            dom, console = _chromium("--dump-dom", url)
            for old in OUT.glob(f"{name}*.png"):
                if old.stem == name or old.stem.removeprefix(name + "-").isdigit():
                    old.unlink()
            shot = OUT / f"{name}.png"
            _chromium(f"--screenshot={shot}", f"--window-size=1280,{TALLEST if a.whole else PART}", url)
            if a.whole:
                _cut(shot)
            found = problems(dom, console)
            failed += bool(found)
            print(f"{'FAIL' if found else 'ok  '} {name}" + "".join(f"\n     - {f}" for f in found))
    finally:
        server.shutdown()
        shutil.rmtree(site, ignore_errors=True)
    print(f"screenshots: {OUT}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
