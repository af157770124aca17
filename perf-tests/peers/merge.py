#!/usr/bin/env python3
"""merge.py -- merge the JSON results of a perf-tests/compare run into markdown tables.
Stdlib only.

    python3 merge.py --dir RESULTS [--labels qccl,mpi-tcp,mpi-shm,mpich-tcp,mpich-shm,gloo]
                     [--np "2 4"] [--runs 2] [--svg-dir DIR]

Layout read (written by perf-tests/compare):
    RESULTS/run<R>/np<N>/<label>.json   collective results: a JSON list of objects with at
                                        least "size" (bytes) and "busbw" (GB/s, 1e9 B/s);
                                        "time_us" and "algbw" are used when present.
                                        {"results": [...]} is accepted too.
    RESULTS/run<R>/np<N>/<label>.timedout   the run hit compare's --timeout: the sizes its
                                        JSON lacks show "t/o" instead of "—"
    RESULTS/run<R>/memcpy.json          memcpy_bw.c output
    RESULTS/run<R>/tcp.json             tcp_bw.py output
    RESULTS/run<R>/np<N>/<label>.rtt    "UNIX_TIME NS" lines: the CPU round trip sampled
                                        during that run (core_rtt.c), optional
    RESULTS/rtt-start.rtt               the same, sampled at the start (placement baseline)
    RESULTS/notes.txt                   free text appended under the tables (optional)

Prints, per world size, one table: size | <label> busbw ... | qccl/<peer> ratios, every cell
holding all runs as "run1 / run2"; then rows for the average busbw over the sizes (nccl-tests'
"Avg bus bandwidth"; a ratio of averages takes only the sizes both sides measured) and the time
at the smallest size; then the machine-limit lines (memcpy, loopback TCP).

Like with like: a peer whose results say "in_place": true (Gloo: torch's all_reduce works in
place) is divided into qccl's in-place figures ("inplace_busbw", shown in their own column),
every other peer (MPI_Allreduce with two buffers) into qccl's out-of-place "busbw". When qccl's
results have no in-place figures, a note under the table says the in-place peers were divided
into the out-of-place ones.

With --svg-dir, each world size is also drawn as DIR/busbw-np<N>.svg: busbw against size on a
log2 axis, one line per label and run (and qccl's in-place figures as their own line when a
peer is set against them), the same drawing as qccl-perf --plot; the table links it.

Placement: a round-trip sample is "far" when it is over twice the fastest sample of the
session (all .rtt files); a run is near (<= 25% far samples), mixed, or far (>= 75%). Cells of
far runs end in "f", of mixed runs in "m"; a ratio whose two runs differ in placement ends
in "?" (not comparable: the host moved the vCPUs in between). Each table is followed by
every run's placement.
"""
import argparse
import json
import math
import os
import sys
from xml.sax.saxutils import escape


def load(path):
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(d, dict):
        d = d.get("results", [])
    out = {}
    for r in d:
        try:
            out[int(r["size"])] = r
        except (KeyError, TypeError, ValueError):
            pass
    return out or None


def human(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:.1f} {unit}"
    return f"{n} B"


def fmt(v, nd=2):
    if v is None:
        return "—"
    if v != 0 and abs(v) < 10 ** -nd:
        return f"{v:.1e}"
    return f"{v:.{nd}f}"


TIMED_OUT = object()  # a size the run did not reach before compare's --timeout


def cell(vals, nd=2, marks=None):
    """'run1 / run2 / ...'; marks[i] (e.g. "f") is appended to a value that is present."""
    out = []
    for i, v in enumerate(vals):
        t = "t/o" if v is TIMED_OUT else fmt(v, nd)
        if marks and marks[i] and v is not None and v is not TIMED_OUT:
            t += marks[i]
        out.append(t)
    return " / ".join(out)


def rtt_samples(path):
    """The round-trip samples (ns) of a core_rtt log; [] when absent or unreadable."""
    try:
        with open(path) as f:
            rows = [ln.split() for ln in f]
    except OSError:
        return []
    out = []
    for r in rows:
        try:
            out.append(float(r[-1]))
        except (IndexError, ValueError):
            pass
    return out


FAR = 2.0  # a round-trip sample over FAR x the session's fastest is "far"


def rtt_baseline(d):
    """The fastest round trip sampled anywhere in the session, or None."""
    best = None
    paths = [os.path.join(d, "rtt-start.rtt")]
    for root, _, files in os.walk(d):
        paths += [os.path.join(root, f) for f in files if f.endswith(".rtt")]
    for p in paths:
        for v in rtt_samples(p):
            if v > 0 and (best is None or v < best):
                best = v
    return best


class Placement:
    """Where the host had the two CPUs during one run, from its round-trip samples."""

    def __init__(self, samples, base):
        self.n = len(samples)
        far = sum(1 for v in samples if v > FAR * base)
        self.share = far / self.n
        self.median = sorted(samples)[self.n // 2]
        self.kind = "near" if self.share <= 0.25 else "far" if self.share >= 0.75 else "mixed"

    def mark(self):
        return {"near": "", "far": "f", "mixed": "m"}[self.kind]

    def __str__(self):
        return f"{self.kind} ({self.median:.0f} ns, {100 * self.share:.0f}% far)"


COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]


def size_label(n):
    """A size as nccl-tests users write it: 512, 4K, 64M, 2G (powers of 1024)."""
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m:
            v = n / m
            return f"{v:g}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n:g}"


def nice_step(top, n=5.0):
    raw = max(top / n, 1e-300)
    p = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * p >= raw:
            return m * p
    return 10 * p


def svg(title, series):
    """The SVG text of a busbw-vs-size plot: series = [(label, [(bytes, GB/s), ...])], one
    <polyline> each (the same drawing as qccl-perf --plot, perf-tests/src/plot.rs)."""
    W, H, L, R, T, B = 860.0, 480.0, 70.0, 230.0, 40.0, 60.0
    pw, ph = W - L - R, H - T - B
    pts = [[(x, y) for x, y in p if x > 0 and math.isfinite(x) and math.isfinite(y)]
           for _, p in series]
    xs = [math.log2(x) for p in pts for x, _ in p]
    lo, hi = (math.floor(min(xs)), math.ceil(max(xs))) if xs else (10, 20)
    if hi - lo < 1:
        lo, hi = lo - 1, hi + 1
    ytop = max([y for p in pts for _, y in p] + [0.0])
    ystep = nice_step(ytop if ytop > 0 else 1.0)
    ymax = max(math.ceil(ytop / ystep), 1) * ystep

    def px(b):
        return L + (math.log2(b) - lo) / (hi - lo) * pw

    def py(g):
        return T + ph - max(g, 0.0) / ymax * ph

    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:g}" height="{H:g}" '
           f'viewBox="0 0 {W:g} {H:g}" font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{L + pw / 2:g}" y="22" text-anchor="middle" font-size="14">'
           f'{escape(title)}</text>',
           '<g stroke="#ddd" stroke-width="1">']
    labels = []
    every = max(math.ceil((hi - lo) / 12), 1)
    for e in range(lo, hi + 1, every):
        x = px(2.0 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{T:g}" x2="{x:.1f}" y2="{T + ph:.1f}"/>')
        labels.append(f'<text x="{x:.1f}" y="{T + ph + 18:.1f}" text-anchor="middle">'
                      f'{size_label(2 ** e)}</text>')
    k = 0
    while k * ystep <= ymax * (1 + 1e-9):
        v = k * ystep
        y = py(v)
        out.append(f'<line x1="{L:g}" y1="{y:.1f}" x2="{L + pw:.1f}" y2="{y:.1f}"/>')
        labels.append(f'<text x="{L - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
        k += 1
    out.append("</g>")
    out.append(f'<rect x="{L:g}" y="{T:g}" width="{pw:g}" height="{ph:g}" fill="none" '
               f'stroke="black"/>')
    out += labels
    out.append(f'<text x="{L + pw / 2:.1f}" y="{H - 16:.1f}" text-anchor="middle">'
               f'message size (bytes, log2)</text>')
    out.append(f'<text x="16" y="{T + ph / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {T + ph / 2:.1f})">busbw (GB/s)</text>')
    for i, ((label, _), p) in enumerate(zip(series, pts)):
        c = COLORS[i % len(COLORS)]
        lab = escape(label)
        out.append(f'<g class="series" data-label="{lab}">')
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in p)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{coords}">'
                   f'<title>{lab}</title></polyline>')
        for x, y in p:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{c}">'
                       f'<title>{lab}: {x:g} B, {y:g} GB/s</title></circle>')
        ly, lx = T + 10 + 18 * i, L + pw + 16
        out.append(f'<line x1="{lx:g}" y1="{ly:g}" x2="{lx + 24:g}" y2="{ly:g}" stroke="{c}" '
                   f'stroke-width="2"/>')
        out.append(f'<text x="{lx + 30:g}" y="{ly + 4:g}">{lab}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--labels", default="qccl,mpi-tcp,mpi-shm,mpich-tcp,mpich-shm,gloo")
    ap.add_argument("--np", default=None, help='world sizes, e.g. "2 4" (default: found)')
    ap.add_argument("--runs", type=int, default=None, help="number of runs (default: found)")
    ap.add_argument("--ref", default="qccl", help="label the ratio columns divide by a peer")
    ap.add_argument("--placement", metavar="RTT_FILE",
                    help="print only this run's placement (compare uses it); nothing without samples")
    ap.add_argument("--far-above", action="store_true",
                    help="print only the round trip (ns) above which a sample is far")
    ap.add_argument("--svg-dir", metavar="DIR",
                    help="also draw each world size as DIR/busbw-np<N>.svg (linked from the table)")
    a = ap.parse_args()

    d = a.dir
    base = rtt_baseline(d)
    if a.placement or a.far_above:
        if base is None:
            return 0
        if a.far_above:
            print(f"{FAR * base:.0f}")
        else:
            smp = rtt_samples(a.placement)
            if smp:
                print(Placement(smp, base))
        return 0
    runs = a.runs or len([x for x in os.listdir(d) if x.startswith("run")])
    if a.np:
        nps = [int(x) for x in a.np.replace(",", " ").split()]
    else:
        found = set()
        for r in range(1, runs + 1):
            rd = os.path.join(d, f"run{r}")
            if os.path.isdir(rd):
                found |= {int(x[2:]) for x in os.listdir(rd) if x.startswith("np")}
        nps = sorted(found)
    labels = [x for x in a.labels.split(",") if x]
    ref = a.ref
    missing = []

    print(f"# qccl vs peers: all_reduce float32 sum, busbw in GB/s (1e9 B/s), "
          f"cells = run1 / run2{' / …' if runs > 2 else ''}\n")
    for n in nps:
        res = {}  # label -> [per run dict or None]
        tmo = {}  # label -> [per run: hit the timeout]
        for lab in labels:
            per, to = [], []
            for r in range(1, runs + 1):
                p = os.path.join(d, f"run{r}", f"np{n}", f"{lab}.json")
                x = load(p)
                to.append(os.path.exists(p[: -len(".json")] + ".timedout"))
                if x is None and os.path.exists(os.path.dirname(p)):
                    missing.append(f"np {n} run {r}: {lab}" + (" (timed out)" if to[-1] else ""))
                per.append(x)
            if any(per) or any(to):
                res[lab] = per
                tmo[lab] = to
        place = {}  # label -> [per run Placement or None]
        for lab in res:
            place[lab] = []
            for r in range(1, runs + 1):
                smp = rtt_samples(os.path.join(d, f"run{r}", f"np{n}", f"{lab}.rtt"))
                place[lab].append(Placement(smp, base) if smp and base else None)
        present = [lab for lab in labels if lab in res]
        peers = [lab for lab in present if lab != ref]
        has_ref = ref in res
        sizes = sorted({s for lab in present for x in res[lab] if x for s in x})
        print(f"## {n} ranks\n")
        if not present:
            print("(no results)\n")
            continue
        def in_place(lab):
            return any(v.get("in_place") for x in res[lab] if x for v in x.values())

        # qccl's in-place column, when some peer measured in place and qccl reported it
        ip_ref = has_ref and any(in_place(p) for p in peers) and any(
            v.get("inplace_busbw") is not None for x in res[ref] if x for v in x.values())
        # (label, busbw key, time key, header) of every busbw column
        cols = []
        for lab in present:
            cols.append((lab, "busbw", "time_us", f"{lab} busbw"))
            if lab == ref and ip_ref:
                cols.append((lab, "inplace_busbw", "inplace_time_us", f"{lab} in-place busbw"))

        def ref_key(p):  # which of qccl's figures peer p is compared with
            return "inplace_busbw" if ip_ref and in_place(p) else "busbw"

        head = ["size"] + [h for _, _, _, h in cols]
        if has_ref:
            head += [f"{ref}/{p}" for p in peers]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))

        def get(lab, r, s, key="busbw"):
            x = res[lab][r]
            if not x or s not in x:
                return None
            v = x[s].get(key)
            return float(v) if v is not None else None

        def marks(lab):
            return [p.mark() if p else "" for p in place[lab]]

        def ratio_marks(p):  # "?": the two runs had the CPUs placed differently
            out = []
            for a, b in zip(place.get(ref, [None] * runs), place[p]):
                out.append("?" if a and b and a.kind != b.kind else "")
            return out

        def get_or_tmo(lab, r, s, key="busbw"):
            v = get(lab, r, s, key)
            return TIMED_OUT if v is None and tmo[lab][r] else v

        for s in sizes:
            row = [human(s)]
            for lab, key, _, _ in cols:
                row.append(cell([get_or_tmo(lab, r, s, key) for r in range(runs)], 2, marks(lab)))
            if has_ref:
                for p in peers:
                    ratios = []
                    for r in range(runs):
                        q, v = get(ref, r, s, ref_key(p)), get(p, r, s)
                        ratios.append(q / v if q is not None and v else None)
                    row.append(cell(ratios, 2, ratio_marks(p)))
            print("| " + " | ".join(row) + " |")

        # average busbw over the sizes each run measured (nccl-tests' Avg bus bandwidth)
        def mean(lab, r, key="busbw", only=None):  # "t/o" for a run cut short
            x = res[lab][r]
            if tmo[lab][r]:
                return TIMED_OUT
            if not x:
                return None
            vals = [float(v[key]) for s, v in x.items()
                    if v.get(key) is not None and (only is None or s in only)]
            return sum(vals) / len(vals) if vals else None

        def common(a, ka, b, kb, r):  # sizes both runs measured, so a ratio compares like sizes
            xa, xb = res[a][r] or {}, res[b][r] or {}
            return {s for s in xa if xa[s].get(ka) is not None} & {
                s for s in xb if xb[s].get(kb) is not None}

        row = ["**avg busbw**"]
        row += [cell([mean(lab, r, key) for r in range(runs)], 2, marks(lab))
                for lab, key, _, _ in cols]
        if has_ref:
            for p in peers:
                ratios = []
                for r in range(runs):
                    both = common(ref, ref_key(p), p, "busbw", r)
                    q, v = mean(ref, r, ref_key(p), both), mean(p, r, "busbw", both)
                    ok = q not in (None, TIMED_OUT) and v not in (None, TIMED_OUT) and v
                    ratios.append(q / v if ok else None)
                row.append(cell(ratios, 2, ratio_marks(p)))
        print("| " + " | ".join(row) + " |")
        if sizes:
            s0 = sizes[0]
            row = [f"**time @ {human(s0)} (µs)**"]
            row += [cell([get(lab, r, s0, tkey) for r in range(runs)], 1, marks(lab))
                    for lab, _, tkey, _ in cols]
            if has_ref:
                row += [""] * len(peers)
            print("| " + " | ".join(row) + " |")
        print()
        if a.svg_dir:
            series = []
            for lab, key, _, head in cols:
                for r in range(runs):
                    x = res[lab][r]
                    if not x:
                        continue
                    pts = [(s, float(v[key])) for s, v in sorted(x.items())
                           if v.get(key) is not None]
                    name = head[: -len(" busbw")] if head.endswith(" busbw") else head
                    series.append((f"{name} run {r + 1}" if runs > 1 else name, pts))
            os.makedirs(a.svg_dir, exist_ok=True)
            path = os.path.join(a.svg_dir, f"busbw-np{n}.svg")
            with open(path, "w") as f:
                f.write(svg(f"all_reduce float32 sum on {n} ranks: busbw vs size", series))
            print(f"![busbw vs size, {n} ranks]({os.path.relpath(path, d)})\n")
        unmatched = [p for p in peers if in_place(p)] if has_ref and not ip_ref else []
        if unmatched:
            print(f"note: {', '.join(unmatched)} measured in place, but {ref}'s results have no "
                  f"in-place figures: {ref}/{unmatched[0]} divides {ref}'s out-of-place busbw\n")
        placed = [lab for lab in present if any(place[lab])]
        if placed:
            print(f"placement of the two CPUs during each run (median round trip; far = over "
                  f"{FAR:g} × {base:.0f} ns, the session's fastest): "
                  + "; ".join(f"{lab} " + " / ".join(str(p) if p else "—" for p in place[lab])
                              for lab in placed) + "\n")

    # machine limits
    mem, tcp = {}, {}
    for r in range(runs):
        x = None
        try:
            with open(os.path.join(d, f"run{r + 1}", "memcpy.json")) as f:
                x = json.load(f)
        except (OSError, ValueError):
            pass
        for e in x or []:
            mem.setdefault((e["size"], e["threads"]), [None] * runs)[r] = e["GBps"]
        x = None
        try:
            with open(os.path.join(d, f"run{r + 1}", "tcp.json")) as f:
                x = json.load(f)
        except (OSError, ValueError):
            pass
        for e in x or []:
            key = (e["streams"], e.get("write_bytes", 0), e.get("tool", "?"))
            tcp.setdefault(key, [None] * runs)[r] = e["GBps"]
    if mem or tcp:
        print("## machine limits (GB/s = 1e9 B/s, run1 / run2)\n")
        for (size, th), v in sorted(mem.items()):
            print(f"- memcpy {human(size)}, {th} thread{'s' if th > 1 else ''} "
                  f"(bytes copied / s, best pass): {cell(v)}")
        for (st, wb, tool), v in sorted(tcp.items()):
            print(f"- loopback TCP, {st} stream{'s' if st > 1 else ''}, {human(wb)} writes "
                  f"({tool}, payload bytes / s): {cell(v)}")
        print()
    notes = os.path.join(d, "notes.txt")
    if missing:
        print("missing results: " + "; ".join(missing) + "\n")
    if os.path.exists(notes):
        with open(notes) as f:
            txt = f.read().strip()
        if txt:
            print(txt + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
