"""A self-contained HTML copy of a markdown report (figures/REPORT.md, diff.md): one file that opens anywhere offline.

    html = markdown_to_html(Path("figures/REPORT.md"))
    write_html(Path("figures/REPORT.md"), Path("figures/REPORT.html"))

Every local image becomes a base64 `data:` URI, the style sheet is embedded, and nothing is fetched from the
network (no CDN script, font or image). Hyperlinks are kept as they are: they load nothing when the page opens.
Every section heading gets an anchor (id) and a table of contents after the title links to them; wide tables
scroll sideways inside their own box instead of being cut.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from markdown_it import MarkdownIt

from repro.atomic import atomic_write_text
from repro.errors import ReproError

MIME_TYPES = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
              ".gif": "image/gif", ".webp": "image/webp"}

# wide report tables scroll inside their own box instead of widening the page
CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; line-height: 1.45; color: #1f2328;
       max-width: 1200px; margin: 2em auto; padding: 0 1em; }
h1, h2, h3 { line-height: 1.2; } h2 { border-bottom: 1px solid #d0d7de; padding-bottom: .2em; margin-top: 2em; }
.table-scroll { overflow-x: auto; max-width: 100%; margin: 1em 0; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: right; white-space: nowrap; }
th { background: #f6f8fa; position: sticky; top: 0; } tr:nth-child(even) td { background: #fafbfc; }
td:first-child, th:first-child { text-align: left; }
code { background: #f6f8fa; padding: 0 .25em; border-radius: 3px; font-size: 0.9em; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; font-size: 0.8em; }
pre code { padding: 0; }
img { max-width: 100%; height: auto; }
nav.toc { background: #f6f8fa; border: 1px solid #d0d7de; padding: .5em 1.2em; font-size: 0.9em; }
nav.toc ul { margin: .2em 0; padding-left: 1.2em; }
h2[id], h3[id] { scroll-margin-top: 1em; }
"""


def _parser() -> MarkdownIt:
    # raw HTML in the markdown is escaped, so no <img src="http..."> can slip past the inlining below
    return MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])


def image_data_uri(src: str, base_dir: Path) -> str:
    """`src` of a markdown image (relative to base_dir, percent-encoded) as a base64 data: URI of the file's bytes."""
    if src.startswith("data:"):
        return src
    if urlparse(src).scheme or src.startswith("//"):
        raise ReproError(f"the report links the remote image {src!r}; save it beside the report so the HTML "
                         "can embed it.")
    path = base_dir / unquote(src)
    mime = MIME_TYPES.get(path.suffix.lower())
    if mime is None:
        raise ReproError(f"image {path} has an unsupported type; use one of {sorted(MIME_TYPES)}.")
    if not path.is_file():
        raise ReproError(f"image {path} linked from the report does not exist; re-render the figures "
                         "(python -m repro.figures) before writing the HTML.")
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def heading_slug(text: str, taken: set[str]) -> str:
    """GitHub's anchor for a heading's text ("Table 2: TTFT / E2E" -> "table-2-ttft--e2e"): lowercase, punctuation
    dropped (letters, digits, "_" and "-" kept), each space a "-", then "-1", "-2", ... for repeats; so a markdown
    link to a heading works on GitHub and in REPORT.html alike. `taken` (the page's slugs so far) is updated."""
    base = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-") or "section"
    slug, n = base, 1
    while slug in taken:
        slug, n = f"{base}-{n}", n + 1
    taken.add(slug)
    return slug


def _anchor_headings(tokens) -> list[tuple[int, str, str]]:
    """Give every h2 / h3 an id; returns [(level, id, heading text)] in page order for the table of contents."""
    taken, toc = set(), []
    for i, token in enumerate(tokens):
        if token.type == "heading_open" and token.tag in ("h2", "h3"):
            text = "".join(c.content for c in tokens[i + 1].children or () if c.type in ("text", "code_inline"))
            slug = heading_slug(text, taken)
            token.attrSet("id", slug)
            toc.append((int(token.tag[1]), slug, text))
    return toc


def _toc_html(toc: list[tuple[int, str, str]]) -> str:
    """A nested list of links to the h2 sections and their h3 subsections; "" for fewer than two sections."""
    if len(toc) < 2:
        return ""
    parts, open_sub = ['<nav class="toc"><strong>Contents</strong>\n<ul>'], False
    for level, slug, text in toc:
        link = f'<a href="#{slug}">{html.escape(text)}</a>'
        if level == 3 and not open_sub and len(parts) > 1:
            parts[-1] = parts[-1].removesuffix("</li>") + "\n<ul>"
            open_sub = True
        elif level == 2 and open_sub:
            parts.append("</ul></li>")
            open_sub = False
        parts.append(f"<li>{link}</li>")
    parts.append("</ul></li>" if open_sub else "")
    return "\n".join(parts) + "\n</ul></nav>\n"


def markdown_to_html(report_md: Path) -> str:
    """The markdown file as one HTML page: tables rendered, local images inlined, CSS embedded."""
    report_md = Path(report_md)
    if not report_md.is_file():
        raise ReproError(f"{report_md} does not exist; render it first (python -m repro.figures).")
    md = _parser()
    tokens = md.parse(report_md.read_text(encoding="utf-8"))
    h1 = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open" and t.tag == "h1"]
    title = h1[0] if h1 else report_md.stem
    for token in tokens:
        for child in token.children or ():
            if child.type == "image":
                child.attrSet("src", image_data_uri(str(child.attrGet("src")), report_md.parent))
    toc = _toc_html(_anchor_headings(tokens))
    body = md.renderer.render(tokens, md.options, {})
    body = body.replace("<table>", '<div class="table-scroll"><table>').replace("</table>", "</table></div>")
    if toc:  # after the title, or first when there is none
        head, sep, rest = body.partition("</h1>\n")
        body = head + sep + toc + rest if sep else toc + body
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{body}</body>\n</html>\n")


def write_html(report_md: Path, out_html: Path) -> Path:
    """Write markdown_to_html(report_md) to out_html atomically (a missing image leaves no file) and return it."""
    atomic_write_text(Path(out_html), markdown_to_html(report_md))
    return Path(out_html)
