//! The `Idempotency-Key` header: parsing and the extractor.

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_core::{Key, MAX_IDENT_BYTES};

use crate::problem::{Problem, types};

/// `Idempotency-Key`, the request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Why an `Idempotency-Key` header was refused. Every variant is a 400 problem response,
/// answered before any SQL runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyRejection {
    /// The route requires a key and the request has none.
    #[error("this operation requires an Idempotency-Key header")]
    Missing,
    /// The header appears more than once.
    #[error("the Idempotency-Key header appears {0} times; send it once")]
    Repeated(usize),
    /// The header is present but holds no key (`""` or only spaces).
    #[error("the Idempotency-Key header is empty")]
    Empty,
    /// The key is longer than [`MAX_IDENT_BYTES`].
    #[error("the idempotency key is {0} bytes long; at most {MAX_IDENT_BYTES} bytes are allowed")]
    TooLong(usize),
    /// The header is neither a structured-field string nor a bare token.
    #[error("the Idempotency-Key header is malformed: {0}")]
    Malformed(String),
}

impl From<KeyRejection> for Problem {
    fn from(e: KeyRejection) -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            types::INVALID_KEY,
            "Invalid Idempotency-Key header",
        )
        .with_detail(e.to_string())
    }
}

impl IntoResponse for KeyRejection {
    fn into_response(self) -> Response {
        Problem::from(self).into_response()
    }
}

/// Parses one `Idempotency-Key` field value.
///
/// Two forms are accepted:
/// - the IETF draft's structured-field string (RFC 8941 `sf-string`): `"8e03978e-…"`,
///   printable ASCII with `\"` and `\\` as the only escapes, and no parameters;
/// - a bare token, as Stripe's clients send: printable ASCII without spaces, `"`, `\`,
///   `,` or `;` (those need the quoted form, or mean a list or parameters).
///
/// Surrounding spaces and tabs are ignored. The key is then checked by [`Key::new`]
/// (1 to 255 bytes).
pub fn parse_key(value: &[u8]) -> Result<Key, KeyRejection> {
    let value = value.trim_ascii();
    let text = if let Some(rest) = value.strip_prefix(b"\"") {
        parse_sf_string(rest)?
    } else {
        if let Some(&b) = value
            .iter()
            .find(|&&b| !(0x21..=0x7e).contains(&b) || matches!(b, b'"' | b'\\' | b',' | b';'))
        {
            return Err(KeyRejection::Malformed(format!(
                "byte 0x{b:02X} is not allowed in a bare key; send printable ASCII without \
                 spaces, '\"', '\\\\', ',' or ';', or a quoted string"
            )));
        }
        // Only printable ASCII is left.
        String::from_utf8_lossy(value).into_owned()
    };
    if text.is_empty() {
        return Err(KeyRejection::Empty);
    }
    if text.len() > MAX_IDENT_BYTES {
        return Err(KeyRejection::TooLong(text.len()));
    }
    Key::new(text).map_err(|e| KeyRejection::Malformed(e.to_string()))
}

/// The rest of an `sf-string` after its opening quote.
fn parse_sf_string(rest: &[u8]) -> Result<String, KeyRejection> {
    let mut out = String::with_capacity(rest.len());
    let mut bytes = rest.iter().copied();
    while let Some(b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(c @ (b'"' | b'\\')) => out.push(char::from(c)),
                _ => {
                    return Err(KeyRejection::Malformed(
                        "only \\\" and \\\\ may be escaped in a quoted key".into(),
                    ));
                }
            },
            b'"' => {
                let trailing = bytes.count();
                if trailing > 0 {
                    return Err(KeyRejection::Malformed(
                        "nothing may follow the closing quote (no parameters, no list)".into(),
                    ));
                }
                return Ok(out);
            }
            0x20..=0x7e => out.push(char::from(b)),
            other => {
                return Err(KeyRejection::Malformed(format!(
                    "byte 0x{other:02X} is not printable ASCII"
                )));
            }
        }
    }
    Err(KeyRejection::Malformed(
        "the quoted key has no closing quote".into(),
    ))
}

/// Reads the key from request headers: `Ok(None)` when there is none.
pub fn key_from_headers(headers: &HeaderMap) -> Result<Option<Key>, KeyRejection> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let more = values.count();
    if more > 0 {
        return Err(KeyRejection::Repeated(more + 1));
    }
    parse_key(first.as_bytes()).map(Some)
}

/// The `Idempotency-Key` of a request, as an extractor.
///
/// As `IdempotencyKey` the key is required (missing → 400); as `Option<IdempotencyKey>`
/// it is optional (missing → `None`, but a malformed key is still 400). It reads only
/// the headers, so it runs before the body is read and before any SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(pub Key);

impl IdempotencyKey {
    /// The validated key.
    pub fn key(&self) -> &Key {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = KeyRejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        key_from_headers(&parts.headers)?
            .map(Self)
            .ok_or(KeyRejection::Missing)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = KeyRejection;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(key_from_headers(&parts.headers)?.map(Self))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use axum::http::HeaderValue;

    fn ok(v: &str) -> String {
        parse_key(v.as_bytes()).unwrap().as_str().to_owned()
    }

    #[test]
    fn both_forms_are_accepted() {
        assert_eq!(ok(r#""8e03978e-40d5""#), "8e03978e-40d5");
        assert_eq!(ok("checkout-42"), "checkout-42");
        assert_eq!(ok("  checkout-42\t"), "checkout-42");
        assert_eq!(ok(r#""a b, c; d""#), "a b, c; d");
        assert_eq!(ok(r#""q\"\\""#), r#"q"\"#);
        assert_eq!(ok(&"x".repeat(255)), "x".repeat(255));
    }

    #[test]
    fn bad_keys_are_refused_with_a_reason() {
        let err = |v: &[u8]| parse_key(v).unwrap_err();
        assert_eq!(err(b""), KeyRejection::Empty);
        assert_eq!(err(b"\"\""), KeyRejection::Empty);
        assert_eq!(err(b"   "), KeyRejection::Empty);
        assert_eq!(err("x".repeat(256).as_bytes()), KeyRejection::TooLong(256));
        assert!(matches!(err(b"a b"), KeyRejection::Malformed(_)));
        assert!(matches!(err(b"a,b"), KeyRejection::Malformed(_)));
        assert!(matches!(err(b"\"abc"), KeyRejection::Malformed(_)));
        assert!(matches!(err(b"\"a\";p=1"), KeyRejection::Malformed(_)));
        assert!(matches!(err(b"\"a\", \"b\""), KeyRejection::Malformed(_)));
        assert!(matches!(err(b"\"a\\nb\""), KeyRejection::Malformed(_)));
        assert!(matches!(
            err("\"é\"".as_bytes()),
            KeyRejection::Malformed(_)
        ));
        assert!(matches!(err(&[0xff, b'a']), KeyRejection::Malformed(_)));
    }

    #[test]
    fn headers_give_none_one_or_a_rejection() {
        let mut h = HeaderMap::new();
        assert_eq!(key_from_headers(&h), Ok(None));
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("k1"));
        assert_eq!(
            key_from_headers(&h).unwrap().map(|k| k.as_str().to_owned()),
            Some("k1".to_owned())
        );
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("k1"));
        assert_eq!(key_from_headers(&h), Err(KeyRejection::Repeated(2)));
    }
}
