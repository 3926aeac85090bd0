"""A self-contained HTML report: the comparison table and the plots as inline SVG, no external file,
script or font, so it can be mailed, attached to a pull request or opened offline."""

import html
import io
import time

from lmlab.report.table import Comparison, format_table

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1150px;
       color: #222; padding: 0 1rem; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 2rem; }
table { border-collapse: collapse; font-size: 0.85rem; }
th, td { padding: 0.3rem 0.6rem; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
tr.baseline td { font-weight: 600; }
td.better { color: #17702e; } td.worse { color: #a61b1b; } td.same { color: #666; }
.note { color: #555; font-size: 0.8rem; max-width: 60rem; }
figure { margin: 1rem 0; } svg { max-width: 100%; height: auto; }
pre { background: #f6f6f6; padding: 0.6rem; font-size: 0.75rem; overflow-x: auto; }
"""


def svg(figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: the SVG sits inside HTML


def render(c: Comparison, figures: dict) -> str:
    cls = {"better": "better", "worse": "worse", "≈ baseline": "same", "n<2: untested": "same"}
    head = ["variant", "n", f"{c.metric} mean ± std", "min" if not c.higher_is_better else "max", "p vs baseline",
            "", "tokens/s", "step MB", "peak MB", "params"]
    rows = []
    for row in c.rows:
        verdict = row.verdict(c.baseline, c.alpha, c.higher_is_better)
        p = "-" if row.test is None else f"{row.test.p:.3g}"
        std = f" ± {row.std:.4f}" if row.std is not None else ""
        failed = f" (+{len(row.failed)} failed)" if row.failed else ""
        cells = [row.variant, f"{len(row.values)}{failed}", f"{row.mean:.4f}{std}", f"{row.best:.4f}", p, verdict,
                 "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}",
                 "-" if row.step_mb is None else f"{row.step_mb:,.1f}",
                 "-" if row.peak_mem_mb is None else f"{row.peak_mem_mb:,.0f}",
                 "-" if row.params is None else f"{row.params:,}"]
        tds = "".join(f'<td class="{cls.get(verdict, "")}">{html.escape(x)}</td>' if i == 5 else
                      f"<td>{html.escape(x)}</td>" for i, x in enumerate(cells))
        rows.append(f'<tr class="{"baseline" if row.variant == c.baseline else ""}">{tds}</tr>')
    plots = "".join(f'<figure id="{name}">{svg(fig)}</figure>' for name, fig in figures.items())
    title = f"lmlab compare: {c.source}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="note">Metric <b>{html.escape(c.metric)}</b> ({'higher' if c.higher_is_better else 'lower'} is better), baseline
<b>{html.escape(c.baseline)}</b>. Written {time.strftime('%Y-%m-%d %H:%M')}.</p>
<table><thead><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in head)}</tr></thead>
<tbody>{''.join(rows)}</tbody></table>
<h2>Plots</h2>
{plots}
<h2>As printed by the terminal</h2>
<pre>{html.escape(format_table(c))}</pre>
</body></html>
"""
