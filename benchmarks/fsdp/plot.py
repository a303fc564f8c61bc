"""Hand-written SVG line plots for the FSDP benchmark (no matplotlib, no torch).

render_svg(panels, ...) draws a grid of panels, each a set of line series; reserved_panels
(results) turns run_all.py's results into one panel per (shape, FSDP variant) with one line
per setting (the peak reserved memory of each step), and write_reserved_svg writes the file.

    panels = [{"title": "gpt2-medium / fsdp2",
               "series": [{"label": "torch", "color": "#1f77b4", "dash": None,
                           "points": [(1, 12.3), (2, 12.9), ...]}, ...]}]
"""
import math
from xml.sax.saxutils import escape

# One colour per setting, the same in every panel.
SETTING_COLORS = {
    "torch": "#d62728",
    "torch-avoid-rs": "#ff7f0e",
    "torch-expandable": "#9467bd",
    "ours": "#1f77b4",
    "ours-streamwait": "#2ca02c",
    "ours-expandable": "#17becf",
}
FALLBACK_COLORS = ("#8c564b", "#e377c2", "#bcbd22", "#7f7f7f", "#393b79", "#637939")
RANK_DASHES = (None, "6,3", "2,2", "8,3,2,3")
REFERENCE_COLOR = "#999999"
GIB = float(2 ** 30)


def _num(v):
    """float(v), or None for None / NaN / inf / non-numbers."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def nice_ticks(lo, hi, target=5):
    """Round tick values covering [lo, hi] (about `target` intervals)."""
    lo, hi = float(lo), float(hi)
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw - 1e-12)
    start = math.floor(lo / step + 1e-9) * step
    ticks = []
    t = start
    while t < hi + step * 0.999:
        ticks.append(round(t, 10))
        if t >= hi - 1e-12:
            break
        t += step
    if len(ticks) < 2:
        ticks.append(round(start + step, 10))
    return ticks


def _fmt(v):
    return "%g" % round(v, 6)


def _runs(points):
    """Splits points at missing values: lists of (x, y) with finite numbers."""
    out, cur = [], []
    for p in points:
        x, y = (_num(p[0]), _num(p[1])) if p is not None and len(p) == 2 else (None, None)
        if x is None or y is None:
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append((x, y))
    if cur:
        out.append(cur)
    return out


def render_svg(panels, title="", x_label="step", y_label="GiB", cols=2, panel_w=460,
               panel_h=270, y_from_zero=False, note=""):
    """The SVG document (a str) for `panels` (see the module's docstring)."""
    panels = list(panels) or [{"title": "no results", "series": []}]
    cols = max(1, min(cols, len(panels)))
    rows = int(math.ceil(len(panels) / float(cols)))

    # Legend: every distinct (label, color, dash), in order of first appearance.
    legend, seen = [], set()
    for pan in panels:
        for s in pan.get("series", []):
            if s.get("legend") is False:
                continue
            key = (s.get("label", ""), s.get("color"), s.get("dash"))
            if key not in seen:
                seen.add(key)
                legend.append(key)
    legend_cols = max(1, (cols * panel_w - 20) // 190)
    legend_rows = int(math.ceil(len(legend) / float(legend_cols)))
    top = 34 + (16 if note else 0)
    legend_h = 18 * legend_rows + (8 if legend else 0)
    width = cols * panel_w + 20
    height = top + legend_h + rows * panel_h + 10

    o = []
    o.append('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
             'viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">'
             % (width, height, width, height))
    o.append('<rect x="0" y="0" width="%d" height="%d" fill="white"/>' % (width, height))
    o.append('<text x="%d" y="22" font-size="15" text-anchor="middle" font-weight="bold">%s</text>'
             % (width // 2, escape(title)))
    if note:
        o.append('<text x="%d" y="40" font-size="11" text-anchor="middle" fill="#444">%s</text>'
                 % (width // 2, escape(note)))

    for i, (label, color, dash) in enumerate(legend):
        lx = 20 + (i % legend_cols) * 190
        ly = top + 8 + (i // legend_cols) * 18
        o.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>'
                 % (lx, ly, lx + 26, ly, escape(color or "#000"),
                    ' stroke-dasharray="%s"' % dash if dash else ""))
        o.append('<text x="%d" y="%d">%s</text>' % (lx + 32, ly + 4, escape(label)))

    for idx, pan in enumerate(panels):
        px = 10 + (idx % cols) * panel_w
        py = top + legend_h + (idx // cols) * panel_h
        o.extend(_panel(pan, px, py, panel_w, panel_h, x_label, y_label, y_from_zero))
    o.append("</svg>")
    return "\n".join(o) + "\n"


def _panel(pan, px, py, pw, ph, x_label, y_label, y_from_zero):
    o = []
    ml, mr, mt, mb = 58, 14, 24, 40  # margins inside the panel
    x0, y0, w, h = px + ml, py + mt, pw - ml - mr, ph - mt - mb
    o.append('<text x="%d" y="%d" font-size="12" text-anchor="middle" font-weight="bold">%s</text>'
             % (x0 + w // 2, py + 15, escape(pan.get("title", ""))))
    series = [(s, _runs(s.get("points", []))) for s in pan.get("series", [])]
    xs = [x for _, runs in series for r in runs for x, _ in r]
    ys = [y for _, runs in series for r in runs for _, y in r]
    o.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>'
             % (x0, y0, w, h))
    if not xs:
        o.append('<text x="%d" y="%d" text-anchor="middle" fill="#888">no data</text>'
                 % (x0 + w // 2, y0 + h // 2))
        return o
    xt = nice_ticks(min(xs), max(xs))
    yt = nice_ticks(0.0 if y_from_zero else min(ys), max(ys))
    xlo, xhi, ylo, yhi = xt[0], xt[-1], yt[0], yt[-1]

    def sx(x):
        return x0 + (x - xlo) / (xhi - xlo) * w

    def sy(y):
        return y0 + h - (y - ylo) / (yhi - ylo) * h

    for t in yt:
        o.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e5e5e5"/>'
                 % (x0, sy(t), x0 + w, sy(t)))
        o.append('<text x="%d" y="%.1f" text-anchor="end">%s</text>' % (x0 - 5, sy(t) + 4, _fmt(t)))
    for t in xt:
        o.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#444"/>'
                 % (sx(t), y0 + h, sx(t), y0 + h + 4))
        o.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>'
                 % (sx(t), y0 + h + 16, _fmt(t)))
    o.append('<text x="%d" y="%d" text-anchor="middle">%s</text>'
             % (x0 + w // 2, y0 + h + 32, escape(x_label)))
    o.append('<text x="%d" y="%d" text-anchor="middle" transform="rotate(-90 %d %d)">%s</text>'
             % (px + 14, y0 + h // 2, px + 14, y0 + h // 2, escape(y_label)))
    for s, runs in series:
        color = escape(s.get("color") or "#000")
        dash = s.get("dash")
        width = s.get("width", 1.6)
        for r in runs:
            if len(r) == 1:
                o.append('<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>'
                         % (sx(r[0][0]), sy(r[0][1]), color))
                continue
            pts = " ".join("%.1f,%.1f" % (sx(x), sy(y)) for x, y in r)
            o.append('<polyline fill="none" stroke="%s" stroke-width="%s"%s points="%s">'
                     '<title>%s</title></polyline>'
                     % (color, width, ' stroke-dasharray="%s"' % dash if dash else "", pts,
                        escape(s.get("label", ""))))
    return o


def setting_color(setting, order):
    if setting in SETTING_COLORS:
        return SETTING_COLORS[setting]
    return FALLBACK_COLORS[order % len(FALLBACK_COLORS)]


def reserved_panels(results, key="reserved_peak", reference_key="allocated_peak"):
    """One panel per (shape, fsdp) of run_all.py's results: a line per setting and rank
    (rank 0 solid, others dashed) of the per-step `key` in GiB, plus a grey dotted line of
    the first run's `reference_key` (peak allocated) for scale. Only rank 0's lines go
    in the legend."""
    groups = {}
    order = []
    extra = {}
    for run in results.get("runs", []):
        g = (run.get("shape"), run.get("fsdp"))
        if g not in groups:
            groups[g] = []
            order.append(g)
        groups[g].append(run)
    panels = []
    for g in order:
        series, ref = [], None
        for run in groups[g]:
            setting = run.get("setting", "?")
            if setting not in SETTING_COLORS and setting not in extra:
                extra[setting] = len(extra)
            color = setting_color(setting, extra.get(setting, 0))
            for rk in sorted(run.get("ranks", []), key=lambda r: r.get("rank", 0)):
                steps = rk.get("per_step") or []
                pts = [(s.get("step"), _gib(s.get("primary", {}).get(key))) for s in steps]
                if not pts:
                    continue
                r = int(rk.get("rank", 0))
                series.append({"label": setting + (" (rank %d)" % r if r else ""),
                               "color": color, "dash": RANK_DASHES[r % len(RANK_DASHES)],
                               "points": pts, "legend": r == 0})
                if ref is None and reference_key:
                    ref = {"label": "peak allocated (first setting, rank 0)",
                           "color": REFERENCE_COLOR, "dash": "2,3", "width": 1.2,
                           "points": [(s.get("step"), _gib(s.get("primary", {}).get(reference_key)))
                                      for s in steps]}
        if ref is not None:
            series.append(ref)
        panels.append({"title": "%s / %s" % (g[0], g[1]), "series": series})
    return panels


def _gib(v):
    f = _num(v)
    return None if f is None else f / GIB


def write_reserved_svg(results, path, title="FSDP: peak reserved memory per step"):
    note = ("each step's peak of reserved bytes (the allocator's figures), rank 0 solid, "
            "rank 1 dashed; grey dotted: peak allocated")
    svg = render_svg(reserved_panels(results), title=title, y_label="reserved GiB", note=note)
    with open(path, "w") as f:
        f.write(svg)
    return path
