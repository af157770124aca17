//! Tensor profiles: what a planner knows about a model's gradients.

use qccl::{Error, Result};
use serde::{Deserialize, Serialize};

/// One gradient tensor: its size and how long backprop takes to produce it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorProfile {
    /// Parameter name (e.g. `layer4.2.conv3.weight`); informational only.
    pub name: String,
    /// Number of f32 elements; the gradient is `4 · elems` bytes.
    pub elems: usize,
    /// Seconds of backprop compute to produce this tensor's gradient.
    pub backprop: f64,
}

impl TensorProfile {
    /// Size of the f32 gradient in bytes.
    pub fn bytes(&self) -> usize {
        4 * self.elems
    }
}

/// The gradient tensors of a model **in backprop order**: `tensors[0]` is the first gradient to
/// become ready, i.e. the model's *last* layer (backprop runs from the output to the input).
/// With wait-free backprop, tensor `i` is ready at the prefix sum `Σ_{t≤i} backprop[t]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Free text: where the numbers come from (architecture, how backprop times were set).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// The tensors, first-ready first.
    pub tensors: Vec<TensorProfile>,
}

impl Profile {
    /// Elements of every tensor, in backprop order (what `qccl::fused`'s runners take).
    pub fn sizes(&self) -> Vec<usize> {
        self.tensors.iter().map(|t| t.elems).collect()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True if there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total f32 elements (the model's parameter count).
    pub fn total_elems(&self) -> usize {
        self.tensors.iter().map(|t| t.elems).sum()
    }

    /// Total backprop seconds.
    pub fn total_backprop(&self) -> f64 {
        self.tensors.iter().map(|t| t.backprop).sum()
    }

    /// Rejects negative or non-finite backprop times (the simulator's timeline assumes time
    /// only moves forward).
    pub fn validate(&self) -> Result<()> {
        for (i, t) in self.tensors.iter().enumerate() {
            if !(t.backprop.is_finite() && t.backprop >= 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "profile tensor {i} ({}): backprop {} must be finite and >= 0",
                    t.name, t.backprop
                )));
            }
        }
        Ok(())
    }
}

impl crate::JsonFile for Profile {
    const WHAT: &'static str = "profile";
    fn check(&self) -> Result<()> {
        self.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JsonFile;

    #[test]
    fn json_round_trip_and_validation() {
        let p = Profile {
            note: "n".into(),
            tensors: vec![
                TensorProfile {
                    name: "fc.bias".into(),
                    elems: 10,
                    backprop: 1e-6,
                },
                TensorProfile {
                    name: "fc.weight".into(),
                    elems: 1000,
                    backprop: 0.1 / 3.0,
                },
            ],
        };
        let back = Profile::from_json(&p.to_json()).unwrap();
        assert_eq!(back, p);
        assert_eq!(p.total_elems(), 1010);
        assert_eq!(p.tensors[1].bytes(), 4000);
        let bad = r#"{"tensors":[{"name":"x","elems":1,"backprop":-1.0}]}"#;
        assert!(Profile::from_json(bad).is_err());
        assert!(Profile::from_json("{").is_err());
    }
}
