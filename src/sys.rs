//! Facts about this machine that layers from the log up ask for (a leaf: it imports nothing
//! of qccl's).

/// This machine's host name ("unknown" if it has none that is UTF-8).
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown".into())
}
