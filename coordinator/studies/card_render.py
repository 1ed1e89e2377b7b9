"""A model card written as Markdown or as one self-contained HTML page (every text escaped, the diagram inline SVG)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from html import escape

from coordinator.studies.card_blocks import Block, Bullets, Code, Diagram, Paragraph, Section, Table
from coordinator.studies.card_content import card_sections
from shared.wire.card import ModelCard, ReliabilityBin

__all__ = ["card_html", "card_markdown", "reliability_svg"]

_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|#])")


def _md(text: str) -> str:
    """Plain text as Markdown that shows it as it is: markup characters escaped, one line."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def _md_block(block: Block) -> str:
    if isinstance(block, Paragraph):
        return _md(block.text)
    if isinstance(block, Bullets):
        return "\n".join(f"- {_md(item)}" for item in block.items)
    if isinstance(block, Table):
        lines = ["| " + " | ".join(_md(cell) for cell in block.header) + " |"]
        lines.append("|" + " --- |" * len(block.header))
        lines += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in block.rows]
        return "\n".join(lines)
    if isinstance(block, Code):
        longest = max((len(run) for run in re.findall(r"`+", block.text)), default=0)
        fence = "`" * max(3, longest + 1)
        return f"{fence}{block.language}\n{block.text}\n{fence}"
    return ""  # the diagram: its table follows it


def card_markdown(card: ModelCard) -> str:
    """The card as Markdown: the first section a level-1 heading, the others level 2."""
    parts = []
    for index, section in enumerate(card_sections(card)):
        parts.append(("# " if index == 0 else "## ") + _md(section.title))
        parts += [text for text in (_md_block(block) for block in section.blocks) if text]
    return "\n\n".join(parts) + "\n"


def reliability_svg(bins: Sequence[ReliabilityBin], size: int = 260) -> str:
    """The reliability diagram as inline SVG: each non-empty bin at (mean predicted, observed), the diagonal dashed."""
    pad, span = 34, size - 44

    def x(p: float) -> float:
        return pad + p * span

    def y(p: float) -> float:
        return size - pad + 10 - p * span

    parts = [
        f'<svg class="reliability" viewBox="0 0 {size} {size}" width="{size}" height="{size}" role="img" '
        'aria-labelledby="reliability-title">',
        '<title id="reliability-title">Reliability diagram: observed fraction of positives against the mean '
        "predicted probability, per bin (the table below lists every value)</title>",
        f'<rect x="{x(0)}" y="{y(1)}" width="{span}" height="{span}" fill="none" stroke="#8a93a5"/>',
        f'<line x1="{x(0)}" y1="{y(0)}" x2="{x(1)}" y2="{y(1)}" stroke="#8a93a5" stroke-dasharray="4 3"/>',
    ]
    for tick in (0.0, 0.5, 1.0):
        parts.append(f'<text x="{x(tick)}" y="{y(0) + 14}" font-size="10" text-anchor="middle">{tick:g}</text>')
        parts.append(f'<text x="{x(0) - 4}" y="{y(tick) + 3}" font-size="10" text-anchor="end">{tick:g}</text>')
    most = max((b.count for b in bins), default=0) or 1
    for b in bins:
        if b.count == 0 or b.observed is None or b.predicted is None:
            continue
        radius = 2.5 + 5.5 * (b.count / most) ** 0.5
        label = escape(f"{b.low:.1f}–{b.high:.1f}: {b.count} probabilities, observed {b.observed:.3f}")
        parts.append(
            f'<circle cx="{x(b.predicted):.1f}" cy="{y(b.observed):.1f}" r="{radius:.1f}" fill="#3559e0" '
            f'fill-opacity="0.7"><title>{label}</title></circle>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _html_block(block: Block) -> str:
    if isinstance(block, Paragraph):
        return f"<p>{escape(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, Table):
        head = "".join(f'<th scope="col">{escape(cell)}</th>' for cell in block.header)
        rows = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in block.rows)
        return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'
    if isinstance(block, Code):
        return f"<details><summary>the terms as JSON</summary><pre><code>{escape(block.text)}</code></pre></details>"
    if isinstance(block, Diagram):
        return reliability_svg(block.bins)
    return ""


_STYLE = (
    "body{font:14px/1.45 system-ui,sans-serif;color:#1d2330;max-width:1100px;margin:24px auto;padding:0 16px}"
    "table{border-collapse:collapse;font-variant-numeric:tabular-nums}"
    "th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #e4e7ec;vertical-align:top}"
    ".scroll{overflow-x:auto}pre{background:#f6f7f9;padding:8px;overflow-x:auto}"
    "h1{font-size:20px}h2{font-size:16px;margin-top:24px}"
)


def _section_html(index: int, section: Section) -> str:
    level = 1 if index == 0 else 2
    body = "".join(_html_block(block) for block in section.blocks)
    return f"<section><h{level}>{escape(section.title)}</h{level}>{body}</section>"


def card_html(card: ModelCard) -> str:
    """The card as one HTML page that loads nothing: inline style, inline SVG, every text escaped."""
    sections = "".join(_section_html(index, section) for index, section in enumerate(card_sections(card)))
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(f'Model card: {card.name}')}</title><style>{_STYLE}</style></head>"
        f"<body><main>{sections}</main></body></html>\n"
    )
