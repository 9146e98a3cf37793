"""One self-contained HTML page: inline CSS, relative image paths, no external resources.

The only script is a few lines that, on `load`, write "<loaded>/<total>" figures into
`document.body.dataset.figures`, so a headless browser can check that every image rendered. Tables
arrive pre-formatted (`tables.Table`), figures as `figures.Plot`; this module only lays them out.

Left out on purpose: JavaScript libraries, sortable tables, dark mode.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass

from optquant.report.figures import Plot
from optquant.report.tables import Table

Block = Table | Plot | tuple[Table, ...]  # a tuple is laid out side by side


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    intro: str
    blocks: tuple[Block, ...]


_TEXT_COLUMNS = {"size", "optimizer", "scheme", "metric", "target", "paper", "quantity", "paper claim", "source",
                 "how we check", "ours", "fit notes", "verdict", "status", "reason", "parameter group",
                 "how chosen", "needs"}  # left-aligned

_VERDICT_CLASS = {"supported": "yes", "contradicted": "no", "not resolved at this scale": "partly",
                  "not testable with this design": "untestable"}

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1320px;margin:0 auto;
 padding:1rem 1.6rem 3rem;color:#1d1d1f;line-height:1.45;background:#fff}
h1{font-size:1.6rem;margin:.6rem 0 .2rem}
h2{font-size:1.25rem;margin:2.2rem 0 .5rem;padding-top:.4rem;border-top:2px solid #e5e5e5}
h3{font-size:1rem;margin:1.2rem 0 .3rem}
p{margin:.35rem 0}
.meta{color:#555;font-size:.9rem}
.caveat{background:#eef4fb;border-left:4px solid #4a7fc1;padding:.55rem .8rem;margin:.8rem 0;font-size:.92rem}
nav ol{columns:2;font-size:.92rem;margin:.4rem 0}
.pair{display:flex;flex-wrap:wrap;gap:1.4rem;align-items:flex-start}
.pair>div{flex:0 1 auto;max-width:100%;overflow-x:auto}
.tbl{overflow-x:auto;margin:.4rem 0 .8rem}
table.data{border-collapse:collapse;font-size:12.5px;font-variant-numeric:tabular-nums}
.ttl{font-weight:600;font-size:13.5px;margin:0 0 .25rem}
.paper-ttl{color:#7a5c00}
table.data th{background:#f3f3f3;font-weight:600;border-bottom:1px solid #bbb}
table.data th,table.data td{padding:3px 6px;text-align:right;border-bottom:1px solid #e3e3e3}
table.data th{white-space:normal;min-width:3rem;vertical-align:bottom}
table.data td{white-space:normal}
table.data .t{text-align:left}
table.data td.t{min-width:4rem;max-width:22rem}
.nw{white-space:nowrap}
table.data td.best{font-weight:700;background:#eaf5ea}
table.paper{background:#fbf7e9}
table.paper th{background:#f1e9cc}
table.wrap td{white-space:normal;min-width:6rem;max-width:22rem;vertical-align:top}
td.yes{background:#dcf0d5}td.no{background:#f6d9d9}td.partly{background:#fbf0c9}td.untestable{background:#e6e6ee}td.na{color:#888}
.cap{font-size:12px;color:#555;max-width:60rem;margin:.15rem 0 .6rem}
.pair .cap{width:0;min-width:100%}
.missing{color:#6b5310;background:#fdf6dc;border-left:4px solid #e0c36c;padding:.4rem .7rem;font-size:.9rem}
figure{margin:1rem 0 1.4rem}
figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:12.5px;color:#444;max-width:70rem}
figcaption b{color:#1d1d1f}
details{margin:.4rem 0}
summary{cursor:pointer;color:#2b5d9b}
pre{font-size:11.5px;background:#f7f7f7;padding:.5rem;overflow-x:auto}
"""

SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.images, ok = 0, wide = [];
  for (var i = 0; i < imgs.length; i++) { if (imgs[i].complete && imgs[i].naturalWidth > 0) ok++; }
  document.body.dataset.figures = ok + "/" + imgs.length;
  var boxes = document.querySelectorAll(".tbl, .pair > div");
  for (var j = 0; j < boxes.length; j++) {
    var t = boxes[j].querySelector("table");
    if (t && boxes[j].scrollWidth > boxes[j].clientWidth + 1) wide.push(t.id);
  }
  if (document.documentElement.scrollWidth > window.innerWidth + 1) wide.push("page");
  document.body.dataset.overflow = wide.join(" ");
});
"""

e = html.escape


def table_html(t: Table) -> str:
    if t.missing:
        return f'<h3>{e(t.title)}</h3>\n<p class="missing">{e(t.missing)}</p>'
    cls = "data" + (" paper" if t.paper else "") + (" wrap" if t.key == "claims" else "")
    text = [c.strip() in _TEXT_COLUMNS for c in t.columns]
    head = "".join(f"<th{_cls('t' if text[j] else '')}>{e(c)}</th>" for j, c in enumerate(t.columns))
    body = []
    for i, row in enumerate(t.rows):
        cells = []
        for j, v in enumerate(row):
            names = ["t"] if text[j] else []
            if (i, j) in t.bold:
                names.append("best")
            if t.columns[j] == "verdict":
                names.append(_VERDICT_CLASS.get(v.split(":")[0], "na"))
            cells.append(f"<td{_cls(' '.join(names))}>{_cell(v, text[j])}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    cap = f'<p class="cap">{e(t.caption)}</p>' if t.caption else ""
    ttl = "ttl paper-ttl" if t.paper else "ttl"
    return (
        f'<div class="tbl"><div class="{ttl}">{e(t.title)}</div><table class="{cls}" id="{e(t.key)}">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{cap}</div>"
    )


def _cell(v: str, text: bool) -> str:
    """A number cell breaks only between its parts ("mean ± sd" | "[lo, hi] (n)"), never inside one, so a
    wide table wraps its cells instead of overflowing; a text cell wraps anywhere at spaces."""
    if text or " [" not in v:
        return e(v) if text else f'<span class="nw">{e(v)}</span>'
    head, _, tail = v.partition(" [")
    return f'<span class="nw">{e(head)}</span> <span class="nw">[{e(tail)}</span>'


def _cls(names: str) -> str:
    return f' class="{names}"' if names else ""


def plot_html(p: Plot) -> str:
    if p.missing:
        return f'<h3>{e(p.title)}</h3>\n<p class="missing">{e(p.missing)}</p>'
    return (
        f'<figure id="{e(p.key)}"><img src="{e(p.src)}" alt="{e(p.title)}">'
        f"<figcaption><b>{e(p.title)}.</b> {e(p.caption)}</figcaption></figure>"
    )


def block_html(b: Block) -> str:
    if isinstance(b, tuple):
        return '<div class="pair">' + "".join(f"<div>{table_html(t)}</div>" for t in b) + "</div>"
    return table_html(b) if isinstance(b, Table) else plot_html(b)


def page(title: str, header: str, sections: list[Section], spec: dict) -> str:
    toc = "".join(f'<li><a href="#{e(s.id)}">{e(s.title)}</a></li>' for s in sections)
    body = []
    for s in sections:
        body.append(f'<section id="{e(s.id)}"><h2>{e(s.title)}</h2><p>{e(s.intro)}</p>')
        body.extend(block_html(b) for b in s.blocks)
        body.append("</section>")
    spec_html = (
        "<details><summary>study spec (study.json)</summary>"
        f"<pre>{e(json.dumps(spec, indent=2, default=str))}</pre>"
        "</details>"
        if spec
        else ""
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{e(title)}</title>'
        f"<style>{CSS}</style><script>{SCRIPT}</script></head>\n<body>\n<h1>{e(title)}</h1>\n{header}\n"
        f"{spec_html}<nav><ol>{toc}</ol></nav>\n" + "\n".join(body) + "\n</body></html>\n"
    )
