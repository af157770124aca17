//! The `field=value` list of a codec spec (`qsgd:bits=4,bucket=128`): the spec parser splits
//! it, each codec takes its own fields (a leaf, so codecs and the spec parser both use it).

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fmt;

/// The `field=value` list of one spec, consumed field by field; leftovers are errors.
pub struct Fields<'a> {
    text: &'a str,
    name: &'a str,
    map: BTreeMap<&'a str, &'a str>,
    known: Vec<&'static str>,
}

impl<'a> Fields<'a> {
    pub(super) fn parse(text: &'a str, name: &'a str, rest: Option<&'a str>) -> Result<Fields<'a>> {
        let mut map = BTreeMap::new();
        for item in rest.into_iter().flat_map(|r| r.split(',')) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (k, v) = item.split_once('=').ok_or_else(|| {
                Error::invalid(format!(
                    "codec spec \"{text}\": field \"{item}\" is not of the form name=value"
                ))
            })?;
            if map.insert(k.trim(), v.trim()).is_some() {
                return Err(Error::invalid(format!(
                    "codec spec \"{text}\": field {} given twice",
                    k.trim()
                )));
            }
        }
        Ok(Fields {
            text,
            name,
            map,
            known: vec!["ef"],
        })
    }

    fn bad(&self, field: &str, msg: impl fmt::Display) -> Error {
        Error::invalid(format!("codec spec \"{}\": {field} {msg}", self.text))
    }

    fn take(&mut self, field: &'static str) -> Option<&'a str> {
        self.known.push(field);
        self.map.remove(field)
    }

    /// An integer field in `range`, `default` when absent.
    pub fn int(
        &mut self,
        field: &'static str,
        default: u64,
        range: std::ops::RangeInclusive<u64>,
    ) -> Result<u64> {
        let Some(v) = self.take(field) else {
            return Ok(default);
        };
        let x: u64 = v
            .parse()
            .map_err(|_| self.bad(field, format!("must be an integer, got \"{v}\"")))?;
        if !range.contains(&x) {
            return Err(self.bad(
                field,
                format!("must be in {}..={}, got {x}", range.start(), range.end()),
            ));
        }
        Ok(x)
    }

    /// A density in (0, 1]; required.
    pub fn density(&mut self, field: &'static str) -> Result<f64> {
        let v = self
            .take(field)
            .ok_or_else(|| self.bad(field, format!("is required for {}", self.name)))?;
        let x: f64 = v
            .parse()
            .map_err(|_| self.bad(field, format!("must be a number, got \"{v}\"")))?;
        if !(x > 0.0 && x <= 1.0) {
            return Err(self.bad(field, format!("must be in (0, 1], got {v}")));
        }
        Ok(x)
    }

    /// One of `choices` (the first is the default).
    pub fn choice(&mut self, field: &'static str, choices: &[&'static str]) -> Result<usize> {
        let Some(v) = self.take(field) else {
            return Ok(0);
        };
        choices.iter().position(|c| *c == v).ok_or_else(|| {
            self.bad(
                field,
                format!("must be one of {}, got \"{v}\"", choices.join("|")),
            )
        })
    }

    /// A 0/1 switch.
    pub fn flag(&mut self, field: &'static str, default: bool) -> Result<bool> {
        Ok(self.int(field, default as u64, 0..=1)? == 1)
    }

    /// Fails on any field no codec asked for.
    pub fn finish(self) -> Result<()> {
        if let Some((k, _)) = self.map.iter().next() {
            return Err(Error::invalid(format!(
                "codec spec \"{}\": unknown field \"{k}\" for {} (known: {})",
                self.text,
                self.name,
                self.known.join(", ")
            )));
        }
        Ok(())
    }
}
