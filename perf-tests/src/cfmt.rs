//! Numbers as C's printf writes them, so the table reads like nccl-tests' (a leaf: the
//! report and the plot both format with it).

/// C's `%g`: 6 significant digits, trailing zeros removed.
pub fn fmt_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let mag = x.abs().log10().floor() as i32;
    if !(-5..6).contains(&mag) {
        return format!("{x:.5e}");
    }
    let s = format!("{x:.*}", (5 - mag).max(0) as usize);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// C's `%.1e` (`3.1e-02`: two-digit exponent, which Rust's `{:.1e}` does not pad).
pub fn fmt_e(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let s = format!("{x:.1e}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_printf() {
        assert_eq!(fmt_g(3.962354), "3.96235");
        assert_eq!(fmt_g(12.5), "12.5");
        assert_eq!(fmt_g(0.0), "0");
        assert_eq!(fmt_g(1.5e-7), "1.50000e-7");
        assert_eq!(fmt_e(0.031), "3.1e-02");
        assert_eq!(fmt_e(1234.0), "1.2e+03");
    }
}
