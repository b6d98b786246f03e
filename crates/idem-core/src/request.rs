//! The canonical request: the business parameters that form a request's identity.

use std::fmt;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::InvalidInput;

/// The normalized request stored with a key and compared on every retry.
///
/// Two requests are **the same request** when their canonical JSON text is the same:
///
/// - object keys are sorted (recursively) and insignificant whitespace is dropped, so key
///   order and formatting never matter;
/// - numbers are compared as written by the serializer: `100`, `100.0` and `1e2` are
///   three different requests, and so are `0.0` and `-0.0`; a computed `f64` such as
///   `0.3 - 0.1` is kept exactly (`0.19999999999999998`), so its honest retry matches;
/// - strings are compared code point for code point, with no Unicode normalization
///   (NFC and NFD spellings differ), and may contain any character, NUL included;
/// - arrays keep their order.
///
/// Canonicalization is part of your API: build the request from the parameters that
/// define the intent, with defaults filled in and units fixed, before you construct it.
///
/// Every engine stores the canonical text verbatim, and idem compares texts, so what an
/// engine might do to JSON (PostgreSQL's `jsonb` rewrites numbers, MySQL's binary JSON
/// reorders keys) cannot turn an honest retry into a mismatch.
#[derive(Clone)]
pub struct Request {
    value: Value,
    /// The canonical text, or why the value cannot be a request.
    text: Result<String, InvalidInput>,
}

/// How many arrays and objects a request may nest: what serde_json reads back (its
/// recursion limit), so that a stored request can always be parsed again.
pub const MAX_JSON_DEPTH: usize = 127;

impl PartialEq for Request {
    fn eq(&self, other: &Self) -> bool {
        matches!((&self.text, &other.text), (Ok(a), Ok(b)) if a == b)
    }
}

impl Eq for Request {}

impl Request {
    /// Canonicalizes a JSON value (sorts object keys, recursively).
    ///
    /// A value nested deeper than [`MAX_JSON_DEPTH`] is kept as given and refused with
    /// [`InvalidInput`] when a call uses it, before any SQL.
    pub fn new(value: Value) -> Self {
        if depth_exceeds(&value, MAX_JSON_DEPTH) {
            return Self {
                value,
                text: Err(InvalidInput::new(
                    "request",
                    format!("nests deeper than {MAX_JSON_DEPTH} levels"),
                )),
            };
        }
        let value = canonical(value);
        let text = Ok(value.to_string());
        Self { value, text }
    }

    /// Serializes any value into a canonical request.
    pub fn from_serialize<T: Serialize + ?Sized>(value: &T) -> Result<Self, InvalidInput> {
        let request = serde_json::to_value(value).map(Self::new).map_err(|e| {
            InvalidInput::new("request", format!("cannot be serialized as JSON: {e}"))
        })?;
        request.text.as_ref().map_err(Clone::clone)?;
        Ok(request)
    }

    /// Parses stored or supplied JSON text. Duplicate object keys are refused: a
    /// request's identity must not depend on which duplicate a parser keeps.
    pub fn parse(text: &str) -> Result<Self, InvalidInput> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| InvalidInput::new("request", format!("is not valid JSON: {e}")))?;
        let canon = Self::new(value);
        canon.text.as_ref().map_err(Clone::clone)?;
        if has_duplicate_keys(text) {
            return Err(InvalidInput::new("request", "has a duplicate object key"));
        }
        Ok(canon)
    }

    /// The canonical value.
    pub fn value(&self) -> &Value {
        &self.value
    }

    /// The canonical JSON text that backends store (empty for a request refused by
    /// [`Request::new`]; such a request never reaches a backend).
    pub fn to_json(&self) -> String {
        self.as_json().to_owned()
    }

    /// The canonical JSON text, borrowed.
    pub fn as_json(&self) -> &str {
        self.text.as_deref().unwrap_or_default()
    }

    /// Refuses a request that cannot be stored: nested too deeply, or larger than
    /// `max_bytes` of canonical JSON. `what` names it in the error.
    pub(crate) fn check(&self, what: &'static str, max_bytes: usize) -> Result<(), InvalidInput> {
        match &self.text {
            Err(e) => Err(InvalidInput::new(what, e.problem().to_owned())),
            Ok(text) if text.len() > max_bytes => Err(InvalidInput::new(
                what,
                format!(
                    "is {} bytes of canonical JSON, more than the limit of {max_bytes} (Idem::with_max_request_bytes)",
                    text.len()
                ),
            )),
            Ok(_) => Ok(()),
        }
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Request({})", self.as_json())
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_json())
    }
}

impl From<Value> for Request {
    fn from(value: Value) -> Self {
        Self::new(value)
    }
}

/// Whether `value` nests deeper than `limit` (iteratively: a hostile value must not
/// overflow the stack here).
fn depth_exceeds(value: &Value, limit: usize) -> bool {
    let mut stack = vec![(value, 1usize)];
    while let Some((v, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(items) => Box::new(items.iter()),
            Value::Object(map) => Box::new(map.values()),
            _ => continue,
        };
        if depth > limit {
            return true;
        }
        stack.extend(children.map(|c| (c, depth + 1)));
    }
    false
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
    fn computed_floats_round_trip_exactly() {
        let r = Request::new(json!({"amount": 0.3 - 0.1}));
        assert_eq!(r.to_json(), r#"{"amount":0.19999999999999998}"#);
        let back = Request::parse(&r.to_json()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, r);
        assert_ne!(
            Request::new(json!({"a": 0.0})),
            Request::new(json!({"a": -0.0}))
        );
        assert_ne!(
            Request::new(json!({"a": 100})),
            Request::new(json!({"a": 100.0}))
        );
        assert_eq!(
            Request::new(json!({"s": "a\u{0}b"})).to_json(),
            r#"{"s":"a\u0000b"}"#
        );
    }

    #[test]
    fn depth_is_bounded_without_recursion() {
        let mut v = json!(1);
        for _ in 0..=MAX_JSON_DEPTH {
            v = json!([v]);
        }
        assert!(
            Request::new(v.clone())
                .check("request", usize::MAX)
                .is_err()
        );
        let mut ok = json!(1);
        for _ in 0..MAX_JSON_DEPTH {
            ok = json!([ok]);
        }
        let ok = Request::new(ok);
        assert!(ok.check("request", usize::MAX).is_ok());
        assert!(Request::parse(&ok.to_json()).is_ok());
        assert!(ok.check("request", 3).is_err());
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
