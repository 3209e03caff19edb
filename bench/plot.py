"""The tutorial scenario's picture: POST latency over time, both systems, log scale.

``write_plot(result, path)`` takes what ``bench.scenario_tutorial.run``
returns. Every request is a dot at (scheduled time, latency); requests that
timed out are crosses at the timeout and other failures triangles, so a wall
of failures cannot pass for a slow success. Lines are the per-second p50 and
p99 (timeouts included at their timeout, a lower bound).

``python -m bench.plot RESULT.json OUT.png`` redraws it from a saved run: the
scenario's own result, or a ``python -m bench`` results file holding it under
``"tutorial"``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLORS = {"toko-api": "#1f77b4", "tutorial": "#d62728"}


def _ms_label(value: float, _pos: object = None) -> str:
    if value >= 1000:
        return f"{value / 1000:g} s"
    return f"{value:g} ms"


def _fmt_ms(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v >= 1000:
        return f"{v / 1000:.1f} s"
    return f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def write_plot(result: dict[str, Any], path: Path) -> None:
    """Render ``result`` (see bench.scenario_tutorial) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator

    c = result["config"]
    labels: dict[str, str] = result.get("labels", {})
    timeout_ms = float(c["request_timeout_s"]) * 1000.0
    fig, ax = plt.subplots(figsize=(11, 6), dpi=110)
    handles: list[Any] = []
    lowest = timeout_ms
    for i, (key, f) in enumerate(result["systems"].items()):
        color = COLORS.get(key, f"C{i}")
        cols = f["requests_detail"]
        t, lat, codes = cols["t_s"], cols["latency_ms"], cols["outcome"]
        lowest = min([lowest, *(v for v in lat if v > 0)])
        for code, marker, size, alpha in (
            ("o", "o", 3, 0.35),
            ("t", "x", 16, 0.4),
            ("e", "^", 14, 0.6),
        ):
            xs = [t[j] for j, o in enumerate(codes) if o == code]
            ys = [lat[j] for j, o in enumerate(codes) if o == code]
            if xs:
                ax.scatter(
                    xs,
                    ys,
                    s=size,
                    marker=marker,
                    color=color,
                    alpha=alpha,
                    linewidths=0.7 if marker == "x" else 0,
                    rasterized=True,
                )
        bins = f["per_second"]
        mids = [b["t_s"] + 0.5 for b in bins]
        ax.plot(mids, [b["p50_ms"] for b in bins], color=color, lw=2.0)
        ax.plot(mids, [b["p99_ms"] for b in bins], color=color, lw=1.3, ls="--")
        figs = f.get("latency_ms") or {}
        text = f"{labels.get(key, key)}: {f['ok_201']}/{f['requests']} x 201"
        if f["timeouts"]:
            text += f", {f['timeouts']} timed out (x)"
        if f["errors"]:
            text += f", {f['errors']} other errors (triangles)"
        text += f"; p50 {_fmt_ms(figs.get('p50'))}, p99 {_fmt_ms(figs.get('p99'))}"
        mostly_timeouts = f["timeouts"] > f["ok_201"]
        handles.append(
            Line2D(
                [],
                [],
                color=color,
                marker="x" if mostly_timeouts else "o",
                markeredgewidth=1.5,
                ls="",
                markersize=6,
                label=text,
            )
        )
        if key == "tutorial" and f["ok_201"] and f["timeouts"]:
            _annotate_wall(ax, f, color, timeout_ms)
    handles.append(Line2D([], [], color="0.3", lw=2.0, label="p50 of each second"))
    handles.append(Line2D([], [], color="0.3", lw=1.3, ls="--", label="p99 of each second"))
    ax.axhline(timeout_ms, color="0.4", lw=0.8, ls=":")
    ax.text(
        float(c["duration_s"]),
        timeout_ms * 1.4,
        f"the client gives up {c['request_timeout_s']:g} s after a request was due"
        " (up to 1 s later: aiohttp rounds the deadline up)",
        color="0.3",
        fontsize=8,
        ha="right",
        va="bottom",
    )
    ax.set_yscale("log")
    ax.set_ylim(max(0.05, lowest / 2), timeout_ms * 3)
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.yaxis.set_major_formatter(FuncFormatter(_ms_label))
    ax.set_xlim(0, float(c["duration_s"]))
    ax.grid(True, which="major", color="0.88", lw=0.6)
    ax.set_xlabel("time since the load started (s): when each request was due to be sent")
    ax.set_ylabel("POST /produk latency, log scale (each dot a request)")
    ax.set_title(
        f"POST /produk at a steady {c['rate']:g} requests/s while every email takes "
        f"{c['email_delay_s']:g} s ({c['workers']} workers)",
        fontsize=12,
    )
    ax.legend(handles=handles, loc="center right", fontsize=8.5, framealpha=0.95)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _annotate_wall(ax: Any, f: dict[str, Any], color: str, timeout_ms: float) -> None:
    """Point at the few 201s before the Go program's channel filled up."""
    cols = f["requests_detail"]
    ok = [
        (t, v)
        for t, v, o in zip(cols["t_s"], cols["latency_ms"], cols["outcome"], strict=True)
        if o == "o"
    ]
    last_t = max(t for t, _ in ok)
    first_timeout = min(t for t, o in zip(cols["t_s"], cols["outcome"], strict=True) if o == "t")
    ys = sorted(v for _, v in ok)
    anchor = (last_t, ys[len(ys) // 2])
    ax.annotate(
        f"all {len(ok)} of its 201s were due in the first {last_t:.1f} s: its channel's 100\n"
        f"slots, then a few that waited up to {_fmt_ms(ys[-1])} for a free one. From\n"
        f"{first_timeout:.1f} s on, every handler waits for a worker (3 x 2 s: 1.5\n"
        "emails/s) and the requests time out",
        xy=anchor,
        xytext=(0.06, 0.62),
        textcoords="axes fraction",
        fontsize=8.5,
        color=color,
        arrowprops={"arrowstyle": "->", "color": color, "lw": 0.8},
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.plot RESULT.json OUT.png", file=sys.stderr)
        return 2
    data = json.loads(Path(argv[0]).read_text())
    write_plot(data.get("tutorial", data), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
