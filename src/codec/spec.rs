//! Codec spec strings: `name[:field=value,...]`, parsed into a codec plus the call-level
//! error-feedback switch. Used by the Rust API, the C ABI and QCCL_COMPRESSION.
//!
//! ```text
//! none | fp16 | bf16
//! qsgd:bits=B,bucket=N[,scale=maxmin|maxabs][,rounding=stochastic|nearest]   (B 1..=8; 4, 128)
//! topk:density=D | mstopk:density=D[,samplings=30] | randk:density=D
//! efsign | onebit[:bucket=N]                            (N default 512; error feedback on by default)
//! any of them with ef=1 (or ef=0)
//! ```

use super::fields::Fields;
use super::floats::{Half16, Identity};
use super::mstopk::{MsTopK, DEFAULT_SAMPLINGS, MAX_SAMPLINGS};
use super::qsgd::Qsgd;
use super::randk::RandK;
use super::sign::{EfSign, OneBit};
use super::topk::TopK;
use super::Codec;
use crate::error::{Error, Result};
use std::fmt;
use std::sync::Arc;

/// A parsed codec spec: the codec and whether calls wrap it in error feedback.
#[derive(Clone)]
pub struct CodecSpec {
    codec: Arc<dyn Codec>,
    ef: bool,
}

impl fmt::Debug for CodecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CodecSpec({})", self)
    }
}

impl fmt::Display for CodecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.codec.spec();
        let default_ef = default_ef(self.codec.id().name());
        match (self.ef == default_ef, s.contains(':')) {
            (true, _) => write!(f, "{s}"),
            (false, true) => write!(f, "{s},ef={}", self.ef as u8),
            (false, false) => write!(f, "{s}:ef={}", self.ef as u8),
        }
    }
}

impl PartialEq for CodecSpec {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl std::str::FromStr for CodecSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<CodecSpec> {
        CodecSpec::parse(s)
    }
}

/// Codecs that are defined with error feedback (efsign is "error-feedback sign").
fn default_ef(name: &str) -> bool {
    matches!(name, "efsign" | "onebit")
}

impl CodecSpec {
    /// Parses a spec string; a bad spec is rejected with a message naming the bad field.
    pub fn parse(text: &str) -> Result<CodecSpec> {
        let text = text.trim();
        let (name, rest) = match text.split_once(':') {
            Some((n, r)) => (n.trim(), Some(r)),
            None => (text, None),
        };
        let mut f = Fields::parse(text, name, rest)?;
        let ef = f.flag("ef", default_ef(name))?;
        let codec: Arc<dyn Codec> = match name {
            "none" => Arc::new(Identity),
            "fp16" => Arc::new(Half16 { brain: false }),
            "bf16" => Arc::new(Half16 { brain: true }),
            "qsgd" => Arc::new(Qsgd::from_fields(&mut f)?),
            "efsign" => Arc::new(EfSign),
            "onebit" => Arc::new(OneBit::from_fields(&mut f)?),
            "topk" => Arc::new(TopK::new(f.density("density")?)?),
            "mstopk" => {
                let density = f.density("density")?;
                let samplings = f.int(
                    "samplings",
                    DEFAULT_SAMPLINGS as u64,
                    1..=MAX_SAMPLINGS as u64,
                )?;
                Arc::new(MsTopK::new(density, samplings as u32)?)
            }
            "randk" => Arc::new(RandK::new(f.density("density")?)?),
            "" => {
                return Err(Error::invalid(format!(
                    "codec spec \"{text}\": empty codec name"
                )))
            }
            other => {
                return Err(Error::invalid(format!(
                    "codec spec \"{text}\": unknown codec \"{other}\" (known: none, fp16, bf16, \
                     qsgd, topk, mstopk, randk, efsign, onebit)"
                )))
            }
        };
        f.finish()?;
        Ok(CodecSpec { codec, ef })
    }

    /// Wraps a codec (for codecs built in code rather than parsed).
    pub fn new(codec: Arc<dyn Codec>, ef: bool) -> CodecSpec {
        CodecSpec { codec, ef }
    }

    /// The codec.
    pub fn codec(&self) -> &Arc<dyn Codec> {
        &self.codec
    }

    /// Whether calls keep an error-feedback residual for this codec.
    pub fn error_feedback(&self) -> bool {
        self.ef
    }

    /// The same codec with error feedback switched on or off.
    pub fn with_error_feedback(&self, ef: bool) -> CodecSpec {
        CodecSpec {
            codec: self.codec.clone(),
            ef,
        }
    }

    /// True for the `none` codec (no compression at all).
    pub fn is_identity(&self) -> bool {
        self.codec.id() == super::CodecId::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_canonically() {
        for (s, canon) in [
            ("none", "none"),
            ("fp16", "fp16"),
            (" bf16:ef=1 ", "bf16:ef=1"),
            ("fp16:ef=0", "fp16"),
        ] {
            assert_eq!(CodecSpec::parse(s).unwrap().to_string(), canon, "{s}");
        }
    }

    #[test]
    fn bad_specs_name_the_bad_field() {
        for (s, needle) in [
            ("zip", "unknown codec \"zip\""),
            ("", "empty codec name"),
            ("fp16:ef=2", "ef must be in 0..=1"),
            ("fp16:level=3", "unknown field \"level\""),
            ("fp16:ef", "not of the form"),
            ("fp16:ef=1,ef=0", "given twice"),
        ] {
            let e = CodecSpec::parse(s).unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
        }
    }
}
