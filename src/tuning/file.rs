//! The tuning file (QCCL_TUNING_FILE): a header line, then one row a line,
//!
//! ```text
//! # qccl tuning v1
//! # collective links   ranks max_bytes algorithm
//! allreduce    arena   4     64K       tree
//! allreduce    network 3-8   *         sra
//! ```
//!
//! `collective` is `allreduce`, `compressed` (a dense codec), `sparse` (a sparse codec) or `*`;
//! `links` `threads`, `arena`, `sockets`, `network` or `*`; `ranks` `N`, `N-M`, `N-` or `*`;
//! `max_bytes` a size (`4096`, `64K`, `1M`; the row covers calls of fewer bytes) or `*`; the
//! algorithm `ring`, `tree`, `sra`, `allgather` or `hier`. `#` starts a comment. Hand-parsed:
//! the core crate has no serde, and a line format is what a person edits on a cluster.

use super::table::{Pick, Row, Workload};
use super::Links;
use crate::algo::Algo;
use crate::error::{Error, Result};

/// The first line of every tuning file: names the format and its version, so a file of
/// another kind (or a later version) is refused rather than misread.
pub const HEADER: &str = "# qccl tuning v1";

/// The rows of tuning file `text`, checked; errors start with `origin` (the variable and the
/// path) and name the line and what is wrong with it.
pub fn parse(text: &str, origin: &str) -> Result<Vec<Row>> {
    let err = |line: usize, what: String| Error::invalid(format!("{origin}: line {line}: {what}"));
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    match lines.next() {
        Some((_, first)) if first.trim() == HEADER => {}
        _ => {
            return Err(err(
                1,
                format!("the file must start with the line '{HEADER}'"),
            ))
        }
    }
    let mut rows = Vec::new();
    for (n, line) in lines {
        let text = line.split_once('#').map_or(line, |(row, _)| row);
        let fields: Vec<&str> = text.split_whitespace().collect();
        if fields.is_empty() {
            continue;
        }
        rows.push(row(&fields).map_err(|what| err(n, what))?);
    }
    Ok(rows)
}

fn row(fields: &[&str]) -> std::result::Result<Row, String> {
    let &[coll, links, ranks, bytes, algo] = fields else {
        return Err(format!(
            "expected 5 fields (collective links ranks max_bytes algorithm), found {}: '{}'",
            fields.len(),
            fields.join(" ")
        ));
    };
    let coll = match coll {
        "*" => None,
        c => Some(
            Workload::ALL
                .into_iter()
                .find(|k| k.name() == c)
                .ok_or_else(|| {
                    format!("collective '{c}' is not one of allreduce, compressed, sparse, *")
                })?,
        ),
    };
    let links = match links {
        "*" => None,
        l => Some(
            Links::ALL
                .into_iter()
                .find(|k| k.name() == l)
                .ok_or_else(|| {
                    format!("links '{l}' is not one of threads, arena, sockets, network, *")
                })?,
        ),
    };
    let (min_ranks, max_ranks) = parse_ranks(ranks)
        .ok_or_else(|| format!("ranks '{ranks}' is not N, N-M, N- or * (1 <= N <= M)"))?;
    let max_bytes = match bytes {
        "*" => usize::MAX,
        b => crate::config::parse_size(b)
            .and_then(|v| usize::try_from(v).ok())
            .filter(|&v| v > 0 && v < usize::MAX)
            .ok_or_else(|| format!("max_bytes '{b}' is not a size above 0 (4096, 64K, 1M) or *"))?,
    };
    // Algo::parse's own message, without its "invalid argument: " (the whole error has one).
    let parsed = Algo::parse(algo).map_err(|e| match e {
        Error::InvalidArgument(m) => m,
        e => e.to_string(),
    })?;
    let pick = Pick::of(parsed).ok_or_else(|| {
        format!("algorithm '{algo}': a row must choose one of ring, tree, sra, allgather, hier")
    })?;
    Ok(Row {
        coll,
        links,
        min_ranks,
        max_ranks,
        max_bytes,
        pick,
    })
}

/// `N`, `N-M`, `N-` or `*` as (fewest, most) ranks.
fn parse_ranks(s: &str) -> Option<(usize, usize)> {
    let n = |v: &str| v.parse::<usize>().ok().filter(|&v| v >= 1);
    let (a, b) = match s.split_once('-') {
        _ if s == "*" => (1, usize::MAX),
        None => (n(s)?, n(s)?),
        Some((a, "")) => (n(a)?, usize::MAX),
        Some((a, b)) => (n(a)?, n(b)?),
    };
    (a <= b).then_some((a, b))
}
