//! The canonical request: the business parameters that form a request's identity.

use std::fmt;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::InvalidInput;

/// The normalized request stored with a key and compared on every retry.
///
/// Object keys are sorted, and comparison is by JSON value in Rust, so neither key order
/// nor what an engine does to stored JSON (PostgreSQL's `jsonb` reorders keys, MySQL's
/// binary JSON too, MariaDB keeps text verbatim) can turn an honest retry into a
/// mismatch.
///
/// Canonicalization is part of your API: build the request from the parameters that
/// define the intent, with defaults filled in and units fixed, before you construct it.
/// `{"amount": 100}` and `{"amount": 100.0}` are different requests.
#[derive(Clone, PartialEq)]
pub struct Request(Value);

impl Request {
    /// Canonicalizes a JSON value (sorts object keys, recursively).
    pub fn new(value: Value) -> Self {
        Self(canonical(value))
    }

    /// Serializes any value into a canonical request.
    pub fn from_serialize<T: Serialize + ?Sized>(value: &T) -> Result<Self, InvalidInput> {
        serde_json::to_value(value)
            .map(Self::new)
            .map_err(|e| InvalidInput::new("request", format!("cannot be serialized as JSON: {e}")))
    }

    /// Parses stored or supplied JSON text. Duplicate object keys are refused: a
    /// request's identity must not depend on which duplicate a parser keeps.
    pub fn parse(text: &str) -> Result<Self, InvalidInput> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| InvalidInput::new("request", format!("is not valid JSON: {e}")))?;
        let canon = Self::new(value);
        if has_duplicate_keys(text) {
            return Err(InvalidInput::new("request", "has a duplicate object key"));
        }
        Ok(canon)
    }

    /// The canonical value.
    pub fn value(&self) -> &Value {
        &self.0
    }

    /// The canonical JSON text that backends store.
    pub fn to_json(&self) -> String {
        self.0.to_string()
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Request({})", self.0)
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<Value> for Request {
    fn from(value: Value) -> Self {
        Self::new(value)
    }
}

fn canonical(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            let mut sorted = Map::new();
            for (k, v) in entries {
                sorted.insert(k, canonical(v));
            }
            Value::Object(sorted)
        }
        Value::Array(items) => Value::Array(items.into_iter().map(canonical).collect()),
        other => other,
    }
}

/// Whether any JSON object in `text` repeats a key. `text` is already known to be valid.
fn has_duplicate_keys(text: &str) -> bool {
    use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

    struct Check;
    impl<'de> Visitor<'de> for Check {
        type Value = bool;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("JSON")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut dup = false;
            while let Some(k) = map.next_key::<String>()? {
                dup |= !seen.insert(k);
                dup |= map.next_value::<Dup>()?.0;
            }
            Ok(dup)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
            let mut dup = false;
            while let Some(d) = seq.next_element::<Dup>()? {
                dup |= d.0;
            }
            Ok(dup)
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
            Ok(false)
        }
    }
    struct Dup(bool);
    impl<'de> serde::Deserialize<'de> for Dup {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(Check).map(Dup)
        }
    }
    serde_json::from_str::<Dup>(text)
        .map(|d| d.0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_never_matters() {
        let a = Request::parse(r#"{"b":1,"a":{"y":2,"x":[{"q":1,"p":2}]}}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        let b = Request::new(json!({"a": {"x": [{"p": 2, "q": 1}], "y": 2}, "b": 1}));
        assert_eq!(a, b);
        assert_eq!(a.to_json(), r#"{"a":{"x":[{"p":2,"q":1}],"y":2},"b":1}"#);
    }

    #[test]
    fn values_and_types_matter() {
        assert_ne!(
            Request::new(json!({"amount": 100})),
            Request::new(json!({"amount": 101}))
        );
        assert_ne!(
            Request::new(json!({"amount": 100})),
            Request::new(json!({"amount": "100"}))
        );
        assert_ne!(Request::new(json!([1, 2])), Request::new(json!([2, 1])));
    }

    #[test]
    fn duplicate_keys_and_bad_json_are_refused() {
        assert!(
            Request::parse(r#"{"a":1,"a":2}"#)
                .unwrap_err()
                .to_string()
                .contains("duplicate")
        );
        assert!(Request::parse(r#"[{"a":1},{"b":{"c":1,"c":1}}]"#).is_err());
        assert!(
            Request::parse("{")
                .unwrap_err()
                .to_string()
                .contains("not valid JSON")
        );
        assert!(Request::parse(r#"{"a":1,"b":2}"#).is_ok());
    }
}
