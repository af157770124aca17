//! What a compressed call encodes, element by element: a fused buffer is a sequence of
//! segments, each with its own codec (CGX's layer-wise compression). Layers excluded by name
//! or too small travel as plain f32 ([`Identity`]).
//!
//! Algorithms encode arbitrary element ranges of the buffer; a range is cut at segment
//! boundaries and each piece is one self-describing chunk, so the encoded length of any range
//! is a pure function of the plan and the range, known to sender and receiver alike.

use super::floats::Identity;
use super::rng::{Rng, Site};
use super::{Codec, CodecSpec};
use crate::error::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// One layer of a fused buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    /// Its name (matched against the exclude patterns).
    pub name: String,
    /// Elements.
    pub count: usize,
    /// Its own codec (e.g. from the adaptive bit assignment); None: the call's codec.
    pub codec: Option<CodecSpec>,
}

/// The layers of a fused buffer, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Layout {
    /// The layers; their counts add up to the buffer's element count.
    pub layers: Vec<Layer>,
}

impl Layout {
    /// A layout from (name, count) pairs, every layer using the call's codec.
    pub fn new<S: Into<String>>(layers: impl IntoIterator<Item = (S, usize)>) -> Layout {
        Layout {
            layers: layers
                .into_iter()
                .map(|(name, count)| Layer {
                    name: name.into(),
                    count,
                    codec: None,
                })
                .collect(),
        }
    }

    /// Total elements.
    pub fn count(&self) -> usize {
        self.layers.iter().map(|l| l.count).sum()
    }
}

/// Which layers stay uncompressed (QCCL_COMPRESSION_EXCLUDE, QCCL_COMPRESSION_MINIMAL_SIZE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    /// A layer whose name contains one of these travels uncompressed.
    pub exclude: Vec<String>,
    /// A layer (or unlaid-out tensor) with fewer elements travels uncompressed.
    pub min_size: usize,
}

impl Default for Filter {
    fn default() -> Filter {
        Filter {
            exclude: ["bias", "bn", "norm"].map(String::from).to_vec(),
            min_size: 16,
        }
    }
}

impl Filter {
    /// True when a layer of this name and size keeps full precision.
    pub fn keeps(&self, name: &str, count: usize) -> bool {
        count < self.min_size
            || self
                .exclude
                .iter()
                .any(|p| !p.is_empty() && name.contains(p))
    }
}

/// One run of elements sharing a codec.
#[derive(Debug, Clone)]
struct Segment {
    start: usize,
    end: usize,
    codec: Arc<dyn Codec>,
}

/// The per-element codec assignment of one call.
#[derive(Debug, Clone)]
pub struct CodecMap {
    segments: Vec<Segment>,
    count: usize,
    ef: bool,
    sparse: bool,
    text: String,
}

impl CodecMap {
    /// `count` elements all encoded with `spec` (or plain f32 when the filter keeps a tensor
    /// that small).
    pub fn uniform(spec: &CodecSpec, count: usize, filter: &Filter) -> CodecMap {
        let codec: Arc<dyn Codec> = if count < filter.min_size {
            Arc::new(Identity)
        } else {
            spec.codec().clone()
        };
        CodecMap::build(
            vec![Segment {
                start: 0,
                end: count,
                codec,
            }],
            count,
            spec,
        )
    }

    /// The layers of `layout`, each with its own codec or `spec`, filtered.
    pub fn layered(spec: &CodecSpec, layout: &Layout, filter: &Filter) -> CodecMap {
        let mut segments = Vec::with_capacity(layout.layers.len());
        let mut at = 0;
        for l in &layout.layers {
            let codec: Arc<dyn Codec> = if filter.keeps(&l.name, l.count) {
                Arc::new(Identity)
            } else {
                l.codec.as_ref().unwrap_or(spec).codec().clone()
            };
            if l.count > 0 {
                segments.push(Segment {
                    start: at,
                    end: at + l.count,
                    codec,
                });
            }
            at += l.count;
        }
        CodecMap::build(segments, at, spec)
    }

    fn build(segments: Vec<Segment>, count: usize, spec: &CodecSpec) -> CodecMap {
        let text = segments
            .iter()
            .map(|s| format!("{}[{}..{}]", s.codec.spec(), s.start, s.end))
            .collect::<Vec<_>>()
            .join(";");
        CodecMap {
            sparse: spec.codec().is_sparse(),
            ef: spec.error_feedback(),
            segments,
            count,
            text,
        }
    }

    /// Elements covered.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Whether the call keeps an error-feedback residual.
    pub fn error_feedback(&self) -> bool {
        self.ef
    }

    /// Whether the call's codec is a sparsifier (all-gather scheme by default).
    pub fn is_sparse(&self) -> bool {
        self.sparse
    }

    /// True when nothing is actually compressed (every segment is plain f32).
    pub fn is_identity(&self) -> bool {
        self.segments
            .iter()
            .all(|s| s.codec.id() == super::CodecId::None)
    }

    /// A 32-bit fingerprint of the plan (never 0), carried in every frame so that ranks
    /// calling with different codecs or layouts are detected.
    pub fn fingerprint(&self) -> u32 {
        let mut h: u32 = 0x811c_9dc5;
        for b in self.text.bytes().chain([self.ef as u8]) {
            h = (h ^ b as u32).wrapping_mul(0x0100_0193);
        }
        h | 1
    }

    /// The codec of each segment, in order (a codec may repeat).
    pub(crate) fn codecs(&self) -> impl Iterator<Item = &Arc<dyn Codec>> {
        self.segments.iter().map(|s| &s.codec)
    }

    /// The pieces of element range `r`: (piece range, codec). Each is one chunk of the
    /// encoding, whose random draws use the site of its start (`encode`).
    pub(crate) fn pieces(
        &self,
        r: Range<usize>,
    ) -> impl Iterator<Item = (Range<usize>, &Arc<dyn Codec>)> {
        let first = self.segments.partition_point(|s| s.end <= r.start);
        self.segments[first..]
            .iter()
            .take_while(move |s| s.start < r.end)
            .map(move |s| (s.start.max(r.start)..s.end.min(r.end), &s.codec))
            .filter(|(p, _)| !p.is_empty())
    }

    /// Bytes of the encoding of element range `r`.
    pub fn encoded_len(&self, r: Range<usize>) -> usize {
        self.pieces(r)
            .map(|(p, c)| c.max_encoded_len(p.len()))
            .sum()
    }

    /// Encodes `input` (the elements of range `r`) into `out`; returns the bytes written.
    /// Each piece draws from the random stream of `site` with `chunk` = its start element.
    pub fn encode(
        &self,
        r: Range<usize>,
        input: &[f32],
        site: Site,
        out: &mut [u8],
    ) -> Result<usize> {
        debug_assert_eq!(input.len(), r.len());
        self.encode_pieces(r, site, out, |q, c, rng, o| c.encode(&input[q], rng, o))
    }

    /// Encodes range `r` of the plan (`data`, `r.len()` elements) into `out` as `encode` does,
    /// and replaces `data` with its decoding; returns the bytes written.
    pub fn encode_own(
        &self,
        r: Range<usize>,
        data: &mut [f32],
        site: Site,
        out: &mut [u8],
    ) -> Result<usize> {
        debug_assert_eq!(data.len(), r.len());
        self.encode_pieces(r, site, out, |q, c, rng, o| {
            c.encode_own(&mut data[q], rng, o)
        })
    }

    /// Runs `f` on each piece of range `r` in order: the piece's elements relative to `r`,
    /// its codec, its random stream (`site` with `chunk` = its start element) and the rest of
    /// `out`, where it writes and returns its bytes; returns the bytes written in all.
    fn encode_pieces(
        &self,
        r: Range<usize>,
        site: Site,
        out: &mut [u8],
        mut f: impl FnMut(Range<usize>, &dyn Codec, &mut Rng, &mut [u8]) -> Result<usize>,
    ) -> Result<usize> {
        let mut at = 0;
        for (p, c) in self.pieces(r.clone()) {
            let mut rng = Rng::new(Site {
                chunk: p.start as u64,
                ..site
            });
            at += f(
                p.start - r.start..p.end - r.start,
                &**c,
                &mut rng,
                &mut out[at..],
            )?;
        }
        Ok(at)
    }

    /// Subtracts the decoding of range `r` from `out` (error feedback), `scratch` as room.
    pub fn decode_sub(
        &self,
        r: Range<usize>,
        bytes: &[u8],
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let mut at = 0;
        for (p, c) in self.pieces(r.clone()) {
            let len = c.max_encoded_len(p.len());
            let chunk = bytes.get(at..at + len).ok_or_else(|| {
                Error::invalid(format!(
                    "encoding of elements {r:?} is shorter than its pieces"
                ))
            })?;
            c.decode_sub(chunk, &mut out[p.start - r.start..p.end - r.start], scratch)?;
            at += len;
        }
        Ok(())
    }

    /// Decodes the encoding of range `r` into `out` (`add` false) or adds it (`add` true).
    pub fn decode(&self, r: Range<usize>, bytes: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        let mut at = 0;
        for (p, c) in self.pieces(r.clone()) {
            let len = c.max_encoded_len(p.len());
            let chunk = bytes.get(at..at + len).ok_or_else(|| {
                Error::invalid(format!(
                    "encoding of elements {r:?} is {} bytes, shorter than its pieces",
                    bytes.len()
                ))
            })?;
            let dst = &mut out[p.start - r.start..p.end - r.start];
            if add {
                c.decode_add(chunk, dst)?;
            } else {
                c.decode_into(chunk, dst)?;
            }
            at += len;
        }
        if at != bytes.len() {
            return Err(Error::invalid(format!(
                "encoding of elements {r:?} is {} bytes, expected {at}",
                bytes.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layered_plan_cuts_ranges_at_layer_boundaries() {
        let spec = CodecSpec::parse("fp16").unwrap();
        let layout = Layout::new([
            ("conv.weight", 100),
            ("conv.bias", 20),
            ("fc", 5),
            ("fc2", 50),
        ]);
        let plan = CodecMap::layered(&spec, &layout, &Filter::default());
        // bias (excluded) and fc (under 16) stay f32; the others are fp16.
        let h = super::super::HEADER_LEN;
        assert_eq!(
            plan.encoded_len(90..130),
            (h + 20) + (h + 80) + (h + 20) + (h + 10)
        );
        let x: Vec<f32> = (0..175).map(|i| i as f32 * 0.1 + 0.01).collect();
        let mut enc = vec![0u8; plan.encoded_len(0..175)];
        let n = plan.encode(0..175, &x, Site::default(), &mut enc).unwrap();
        assert_eq!(n, enc.len());
        let mut out = vec![0.0; 175];
        plan.decode(0..175, &enc, &mut out, false).unwrap();
        assert_eq!(out[100..125], x[100..125], "uncompressed layers are exact");
        assert!(out
            .iter()
            .zip(&x)
            .all(|(a, b)| (a - b).abs() <= b.abs() / 1000.0));
        assert!(plan.decode(0..175, &enc[..n - 1], &mut out, true).is_err());
        let other = CodecMap::uniform(&spec, 175, &Filter::default());
        assert_ne!(plan.fingerprint(), other.fingerprint());
    }
}
