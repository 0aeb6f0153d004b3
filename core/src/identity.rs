//! The model identity two nodes compare at their first handshake: named fields (model name,
//! shapes, KV dtype, group kinds and windows, block sizes, parallel layout, …), each a short
//! text, so a refusal can say *which* field differs and show both values instead of two hashes.
//!
//! A leg whose KV another leg reads must compute it with the same model the same way; a
//! different seed, dtype or window would still pair block for block and then decode wrong
//! tokens. The fields are whatever the node's engine says defines its KV (the reference engine:
//! its `[model]` section and layout; vLLM's connector: its model config); two nodes agree when
//! every field has the same value on both.

use serde::{Deserialize, Serialize};

/// Most fields a node may describe its model with; more is a malformed hello.
pub const MAX_FIELDS: usize = 64;

/// Longest field name or value, in bytes; longer values are cut (with a digest of the whole
/// value so two long values that differ past the cut still differ).
pub const MAX_FIELD_LEN: usize = 512;

/// A model's identity as named text fields, sorted by name, names unique.
/// Deserialized through [`ModelFields::new`], so fields from a peer are sorted and bounded too.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<(String, String)>")]
pub struct ModelFields(Vec<(String, String)>);

impl TryFrom<Vec<(String, String)>> for ModelFields {
    type Error = IdentityError;

    fn try_from(fields: Vec<(String, String)>) -> Result<Self, IdentityError> {
        Self::new(fields)
    }
}

impl ModelFields {
    /// Builds the fields from `(name, value)` pairs; a later pair of the same name replaces an
    /// earlier one. Refuses more than [`MAX_FIELDS`] fields and over-long names; over-long
    /// values are cut to [`MAX_FIELD_LEN`] bytes ending in a digest of the whole value.
    pub fn new(fields: impl IntoIterator<Item = (String, String)>) -> Result<Self, IdentityError> {
        let mut sorted: Vec<(String, String)> = Vec::new();
        for (name, value) in fields {
            if name.is_empty() || name.len() > MAX_FIELD_LEN {
                return Err(IdentityError::BadName(name.chars().take(64).collect()));
            }
            let value = bounded(value);
            match sorted.binary_search_by(|(existing, _)| existing.as_str().cmp(&name)) {
                Ok(index) => sorted[index].1 = value,
                Err(index) => {
                    if sorted.len() == MAX_FIELDS {
                        return Err(IdentityError::TooMany(MAX_FIELDS));
                    }
                    sorted.insert(index, (name, value));
                }
            }
        }
        Ok(Self(sorted))
    }

    /// The value of field `name`, if the node described it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(existing, _)| existing.as_str().cmp(name))
            .ok()
            .map(|index| self.0[index].1.as_str())
    }

    /// Whether the node described no field (a peer that makes or reads no KV, like a router).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The fields whose values differ between `self` (ours) and `theirs`, by name, including
    /// fields only one side has. Empty when the two agree.
    pub fn differences(&self, theirs: &ModelFields) -> Vec<FieldDifference> {
        let mut names: Vec<&str> = self
            .0
            .iter()
            .chain(&theirs.0)
            .map(|(name, _)| name.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
            .into_iter()
            .filter_map(|name| {
                let (ours, theirs) = (self.get(name), theirs.get(name));
                (ours != theirs).then(|| FieldDifference {
                    name: name.to_string(),
                    ours: ours.map(str::to_string),
                    theirs: theirs.map(str::to_string),
                })
            })
            .collect()
    }

    /// Whether the two agree, or one side makes and reads no KV (no fields): only nodes that
    /// both describe a model must agree on it.
    pub fn compatible(&self, theirs: &ModelFields) -> Result<(), Vec<FieldDifference>> {
        if self.is_empty() || theirs.is_empty() {
            return Ok(());
        }
        let differences = self.differences(theirs);
        if differences.is_empty() {
            Ok(())
        } else {
            Err(differences)
        }
    }
}

fn bounded(value: String) -> String {
    if value.len() <= MAX_FIELD_LEN {
        return value;
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(value.as_bytes());
    let tag: String = digest[..8].iter().map(|byte| format!("{byte:02x}")).collect();
    let mut cut = MAX_FIELD_LEN - tag.len() - "…sha256:".len();
    while !value.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…sha256:{tag}", &value[..cut])
}

/// One field two nodes disagree on, with both values (`None`: that node has no such field).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldDifference {
    /// The field's name.
    pub name: String,
    /// Our value.
    pub ours: Option<String>,
    /// Their value.
    pub theirs: Option<String>,
}

impl FieldDifference {
    /// `name: <ours_label> <value>, <theirs_label> <value>`, naming each side (node names read
    /// better in a log on either side than "ours" and "theirs").
    pub fn describe(&self, ours_label: &str, theirs_label: &str) -> String {
        let show = |value: &Option<String>| value.as_deref().unwrap_or("(not set)").to_string();
        format!(
            "{}: {ours_label} {}, {theirs_label} {}",
            self.name,
            show(&self.ours),
            show(&self.theirs)
        )
    }
}

/// Why a model identity could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// More fields than [`MAX_FIELDS`].
    #[error("a model identity has at most {0} fields")]
    TooMany(usize),
    /// An empty or over-long field name.
    #[error("model identity field name {0:?} is empty or longer than {MAX_FIELD_LEN} bytes")]
    BadName(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> ModelFields {
        ModelFields::new(pairs.iter().map(|(n, v)| (n.to_string(), v.to_string()))).unwrap()
    }

    #[test]
    fn differences_name_each_differing_or_missing_field_with_both_values() {
        let ours = fields(&[("dtype", "bf16"), ("layers", "4"), ("name", "m"), ("tp", "1")]);
        let theirs = fields(&[("tp", "2"), ("name", "m"), ("dtype", "fp8"), ("window", "128")]);
        let differences = ours.differences(&theirs);
        let described: Vec<String> = differences.iter().map(|d| d.describe("p0", "d0")).collect();
        assert_eq!(
            described,
            [
                "dtype: p0 bf16, d0 fp8",
                "layers: p0 4, d0 (not set)",
                "tp: p0 1, d0 2",
                "window: p0 (not set), d0 128",
            ]
        );
        assert_eq!(ours.compatible(&theirs).unwrap_err(), differences);
        assert_eq!(ours.compatible(&ours.clone()), Ok(()));
    }

    #[test]
    fn order_of_construction_does_not_matter_and_a_later_value_wins() {
        let a = fields(&[("b", "2"), ("a", "1"), ("a", "3")]);
        let b = fields(&[("a", "3"), ("b", "2")]);
        assert_eq!(a, b);
        assert_eq!(a.get("a"), Some("3"));
        assert!(a.differences(&b).is_empty());
    }

    #[test]
    fn a_node_without_a_model_is_compatible_with_any() {
        let model = fields(&[("name", "m")]);
        assert_eq!(ModelFields::default().compatible(&model), Ok(()));
        assert_eq!(model.compatible(&ModelFields::default()), Ok(()));
    }

    #[test]
    fn bounds_are_enforced() {
        let many = (0..=MAX_FIELDS).map(|i| (format!("f{i:03}"), String::new()));
        assert_eq!(ModelFields::new(many), Err(IdentityError::TooMany(MAX_FIELDS)));
        assert!(matches!(
            ModelFields::new([(String::new(), "v".into())]),
            Err(IdentityError::BadName(_))
        ));
        // Two long values equal in their first MAX_FIELD_LEN bytes still differ after the cut.
        let long = "é".repeat(MAX_FIELD_LEN);
        let a = fields(&[("v", &format!("{long}a"))]);
        let b = fields(&[("v", &format!("{long}b"))]);
        assert!(a.get("v").unwrap().len() <= MAX_FIELD_LEN);
        assert_ne!(a.get("v"), b.get("v"));
    }
}
