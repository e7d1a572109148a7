"""MkDocs hook: formulas become MathML at build time, so pages show them offline with no script or CDN.

pymdownx.arithmatex (generic mode) marks `$...$` and `$$...$$` in the Markdown and protects them from the
Markdown parser; this hook converts each marked formula with latex2mathml. Browsers render MathML natively
(Chromium 109+, Firefox, Safari). A formula latex2mathml cannot convert fails the build, naming the page.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)
_BLOCK = re.compile(r'<div class="arithmatex">\\\[(.*?)\\\]</div>', re.S)


def to_mathml(latex: str, display: str) -> str:
    return convert(html.unescape(latex).strip(), display=display)


def on_page_content(content, page, config, files, **kwargs):
    def replace(display):
        def one(match):
            try:
                return to_mathml(match.group(1), display)
            except Exception as e:  # noqa: BLE001 - any conversion failure is a broken formula in the page
                raise ValueError(f"{page.file.src_uri}: cannot render formula {match.group(1)!r}: {e}") from e
        return one

    content = _BLOCK.sub(replace("block"), content)
    return _INLINE.sub(replace("inline"), content)
