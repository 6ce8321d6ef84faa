"""Draw a Chrome trace (as `chrome_trace` writes it) as a standalone SVG timeline: one lane
per thread and nesting depth, a box per complete event. A picture without a trace viewer."""

from __future__ import annotations

from html import escape
from typing import Any

_COLORS = {"step": "#c7d2e0", "prefill": "#f4a259", "decode": "#5b8e7d", "verify": "#8cb369",
           "host": "#e9c46a", "eval": "#2a9d8f", "request": "#9db4c0", "compile": "#bc4b51"}


def timeline_svg(trace: dict[str, Any], width: int = 1400, lane: int = 18) -> str:
    evs = trace.get("traceEvents", [])
    names = {e["tid"]: e["args"]["name"] for e in evs if e.get("ph") == "M" and e.get("name") == "thread_name"}
    xs = sorted((e for e in evs if e.get("ph") == "X"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    if not xs:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="8" y="24">empty trace</text></svg>'
    end = max(e["ts"] + e["dur"] for e in xs) or 1.0
    left = 150
    scale = (width - left - 10) / end
    # nesting depth per thread: a stack of open intervals
    placed: list[tuple[dict, int]] = []
    depth_of: dict[int, int] = {}
    stacks: dict[int, list[float]] = {}
    for e in xs:
        st = stacks.setdefault(e["tid"], [])
        while st and e["ts"] >= st[-1] - 1e-3:
            st.pop()
        placed.append((e, len(st)))
        depth_of[e["tid"]] = max(depth_of.get(e["tid"], 0), len(st) + 1)
        st.append(e["ts"] + e["dur"])
    y, lane_y = 30, {}
    for tid in sorted(depth_of):
        lane_y[tid] = y
        y += depth_of[tid] * lane + 6
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 30}" '
             f'font-family="sans-serif" font-size="10">',
             f'<rect width="{width}" height="{y + 30}" fill="white"/>',
             f'<text x="8" y="16" font-size="12">fx-engine timeline: {end / 1e3:.1f} ms, '
             f'{len(xs)} spans (boxes nest: step &gt; prefill/decode/verify &gt; host/eval)</text>']
    for tid, ty in lane_y.items():
        parts.append(f'<text x="8" y="{ty + 12}">{escape(names.get(tid, f"tid {tid}"))}</text>')
        parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{ty - 3}" y2="{ty - 3}" stroke="#eee"/>')
    for e, d in placed:
        x = left + e["ts"] * scale
        w = max(e["dur"] * scale, 0.5)
        yy = lane_y[e["tid"]] + d * lane
        color = _COLORS.get(e.get("cat", ""), "#999")
        title = escape(f"{e['name']}: {e['dur'] / 1e3:.2f} ms")
        parts.append(f'<rect x="{x:.2f}" y="{yy}" width="{w:.2f}" height="{lane - 3}" fill="{color}" '
                     f'stroke="#555" stroke-width="0.3"><title>{title}</title></rect>')
        if w > 7 * len(e["name"]):
            parts.append(f'<text x="{x + 2:.2f}" y="{yy + lane - 7}">{escape(e["name"])}</text>')
    ticks = 10
    for i in range(ticks + 1):
        x = left + end * scale * i / ticks
        parts.append(f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle">{end * i / ticks / 1e3:.0f} ms</text>')
    parts.append("</svg>")
    return "\n".join(parts)
