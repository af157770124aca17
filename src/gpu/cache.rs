//! What the two kernel builders share: the disk cache folder (NVRTC's images, the emulated
//! driver's CPU builds) and the stable hash that keys their files.

use std::path::PathBuf;

/// The disk cache folder from the environment: `QCCL_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/qccl`, else `$HOME/.cache/qccl`; `QCCL_CACHE_DIR=` (empty) turns the disk
/// cache off (None).
pub(crate) fn default_cache_dir(
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    if let Some(dir) = var("QCCL_CACHE_DIR") {
        return (!dir.is_empty()).then(|| PathBuf::from(dir));
    }
    if let Some(xdg) = var("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Some(PathBuf::from(xdg).join("qccl"));
    }
    var("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("qccl"))
}

/// FNV-1a over a sequence of byte strings, each followed by a 0xff separator: a key that is
/// stable across runs and builds (std's hasher promises neither).
pub(crate) struct StableHash(u64);

impl StableHash {
    pub(crate) fn new() -> StableHash {
        StableHash(0xcbf2_9ce4_8422_2325)
    }

    /// Adds one string (and its separator).
    pub(crate) fn eat(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().chain(&[0xff]) {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_dir_from_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |v: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == v)
                    .map(|(_, x)| std::ffi::OsString::from(x))
            }
        };
        let d = |pairs| default_cache_dir(env(pairs));
        assert_eq!(
            d(&[("QCCL_CACHE_DIR", "/c"), ("HOME", "/h")]),
            Some("/c".into())
        );
        assert_eq!(d(&[("QCCL_CACHE_DIR", ""), ("HOME", "/h")]), None);
        assert_eq!(
            d(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]),
            Some("/x/qccl".into())
        );
        assert_eq!(d(&[("HOME", "/h")]), Some("/h/.cache/qccl".into()));
        assert_eq!(d(&[]), None);
    }

    #[test]
    fn hash_separates_strings() {
        let h = |parts: &[&[u8]]| {
            let mut h = StableHash::new();
            parts.iter().for_each(|p| h.eat(p));
            h.finish()
        };
        assert_ne!(h(&[b"ab", b"c"]), h(&[b"a", b"bc"]));
        assert_eq!(h(&[b"ab", b"c"]), h(&[b"ab", b"c"]));
        // The FNV-1a of "a" then the separator, as the NVRTC cache has always keyed files.
        assert_eq!(h(&[b"a"]), {
            let mut x: u64 = 0xcbf2_9ce4_8422_2325;
            for b in [b'a', 0xff] {
                x ^= u64::from(b);
                x = x.wrapping_mul(0x0000_0100_0000_01b3);
            }
            x
        });
    }
}
