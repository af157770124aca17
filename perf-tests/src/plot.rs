//! `--plot FILE.svg`: bus bandwidth against message size as a small SVG, written by hand (no
//! plotting runtime): a log2 size axis, a linear GB/s axis from 0, one `<polyline>` per series
//! (with a dot per point, so a one-point series shows too) and a legend.
//!
//! perf-tests/peers/merge.py draws perf-tests/compare's plots the same way (`--svg-dir`).

use std::fmt::Write as _;

/// One line of the plot.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's text.
    pub label: String,
    /// (size in bytes, busbw in GB/s), in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// Line colours, one per series in turn (Tableau 10).
const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;

/// Text as XML character data.
fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// A size as nccl-tests users write it: 512, 4K, 64M, 2G (powers of 1024).
pub fn size_label(bytes: f64) -> String {
    for (unit, m) in [("G", 1u64 << 30), ("M", 1 << 20), ("K", 1 << 10)] {
        let m = m as f64;
        if bytes >= m {
            let v = bytes / m;
            return if v.fract() == 0.0 {
                format!("{v}{unit}")
            } else {
                format!("{v:.1}{unit}")
            };
        }
    }
    format!("{bytes}")
}

/// A round step for about `n` ticks from 0 to `max`: 1, 2 or 5 times a power of ten.
fn nice_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(f64::MIN_POSITIVE);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p)
}

/// The SVG document: `title` on top, every series' points with a positive size and a finite
/// busbw (others cannot sit on a log axis), one polyline each.
pub fn svg(title: &str, series: &[Series]) -> String {
    let pts = |s: &Series| -> Vec<(f64, f64)> {
        s.points
            .iter()
            .copied()
            .filter(|(x, y)| *x > 0.0 && x.is_finite() && y.is_finite())
            .collect()
    };
    let all: Vec<(f64, f64)> = series.iter().flat_map(pts).collect();
    let (mut lo, mut hi) = all
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), p| {
            (l.min(p.0.log2()), h.max(p.0.log2()))
        });
    if all.is_empty() {
        (lo, hi) = (10.0, 20.0);
    }
    let (mut lo, mut hi) = (lo.floor(), hi.ceil());
    if hi - lo < 1.0 {
        lo -= 1.0;
        hi += 1.0;
    }
    let ymax_data = all.iter().map(|p| p.1).fold(0.0f64, f64::max);
    let ystep = nice_step(if ymax_data > 0.0 { ymax_data } else { 1.0 }, 5.0);
    let ymax = (ymax_data / ystep).ceil().max(1.0) * ystep;
    let (pw, ph) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let x = |bytes: f64| LEFT + (bytes.log2() - lo) / (hi - lo) * pw;
    let y = |gbs: f64| TOP + ph - gbs.max(0.0) / ymax * ph;

    let mut s = String::new();
    let _ = writeln!(s, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + pw / 2.0,
        xml(title)
    );
    // Grid and axes.
    let _ = writeln!(s, r##"<g stroke="#ddd" stroke-width="1">"##);
    let every = ((hi - lo) / 12.0).ceil().max(1.0) as i64;
    let mut labels = String::new();
    for e in (lo as i64..=hi as i64).step_by(every as usize) {
        let px = x(2f64.powi(e as i32));
        let _ = writeln!(
            s,
            r#"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}"/>"#,
            TOP + ph
        );
        let _ = writeln!(
            labels,
            r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + ph + 18.0,
            size_label(2f64.powi(e as i32))
        );
    }
    let mut v = 0.0;
    while v <= ymax * (1.0 + 1e-9) {
        let py = y(v);
        let _ = writeln!(
            s,
            r#"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}"/>"#,
            LEFT + pw
        );
        let _ = writeln!(
            labels,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            py + 4.0,
            crate::cfmt::fmt_g(v)
        );
        v += ystep;
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    s.push_str(&labels);
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">message size (bytes, log2)</text>"#,
        LEFT + pw / 2.0,
        HEIGHT - 16.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">busbw (GB/s)</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    // The series and the legend.
    for (i, ser) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let p = pts(ser);
        let coords: Vec<String> = p
            .iter()
            .map(|&(bx, gy)| format!("{:.1},{:.1}", x(bx), y(gy)))
            .collect();
        let _ = writeln!(s, r#"<g class="series" data-label="{}">"#, xml(&ser.label));
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"><title>{}</title></polyline>"#,
            coords.join(" "),
            xml(&ser.label)
        );
        for &(bx, gy) in &p {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{c}"><title>{}: {} B, {} GB/s</title></circle>"#,
                x(bx),
                y(gy),
                xml(&ser.label),
                bx,
                crate::cfmt::fmt_g(gy)
            );
        }
        let ly = TOP + 10.0 + 18.0 * i as f64;
        let lx = LEFT + pw + 16.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="2"/>"#,
            lx + 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 30.0,
            ly + 4.0,
            xml(&ser.label)
        );
        let _ = writeln!(s, "</g>");
    }
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_steps() {
        assert_eq!(size_label(512.0), "512");
        assert_eq!(size_label(4096.0), "4K");
        assert_eq!(size_label(1536.0), "1.5K");
        assert_eq!(size_label((64u64 << 20) as f64), "64M");
        assert_eq!(size_label((2u64 << 30) as f64), "2G");
        assert_eq!(nice_step(9.3, 5.0), 2.0);
        assert_eq!(nice_step(0.42, 5.0), 0.1);
        assert_eq!(nice_step(120.0, 5.0), 50.0);
    }

    #[test]
    fn one_polyline_per_series_and_escaped_text() {
        let series = [
            Series {
                label: "out-of-place".into(),
                points: vec![(1024.0, 0.5), (4096.0, 1.5), (16384.0, 3.0)],
            },
            Series {
                label: "in-place <&>".into(),
                // Size 0 cannot sit on the log axis: left out.
                points: vec![(0.0, 1.0), (1024.0, 0.4)],
            },
        ];
        let s = svg("all_reduce \"2 ranks\"", &series);
        assert!(s.starts_with("<?xml"), "{s}");
        assert!(s.trim_end().ends_with("</svg>"), "{s}");
        assert_eq!(s.matches("<polyline").count(), 2, "{s}");
        assert_eq!(s.matches("<circle").count(), 4, "{s}");
        assert!(s.contains("in-place &lt;&amp;&gt;"), "{s}");
        assert!(s.contains("all_reduce &quot;2 ranks&quot;"), "{s}");
        assert!(!s.contains("NaN") && !s.contains("inf"), "{s}");
        // Ticks at 1K, 2K, ..., 16K; busbw up to 3 in steps of 1.
        assert!(s.contains(">1K</text>") && s.contains(">16K</text>"), "{s}");
        assert!(s.contains(">3</text>") && s.contains(">1</text>"), "{s}");
        // An empty plot is still a document.
        let e = svg("nothing", &[]);
        assert!(e.contains("</svg>") && !e.contains("<polyline"));
    }
}
