//! The authenticated principal, as authentication left it in the request extensions.

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use idem_core::Principal;

use crate::problem::{Problem, types};

/// The principal your authentication layer inserted into the request extensions
/// (`request.extensions_mut().insert(idem::Principal::new(user_id)?)`).
///
/// It is never read from a client header or the body: a key's scope must come from
/// trusted authentication. Without one the request is refused with 401; as
/// `Option<Authenticated>` the handler decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authenticated(pub Principal);

impl Authenticated {
    /// The principal.
    pub fn principal(&self) -> &Principal {
        &self.0
    }
}

/// No principal was found in the request extensions: authentication did not run or did
/// not succeed. A 401 problem response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this operation requires an authenticated principal")]
pub struct Unauthenticated;

impl IntoResponse for Unauthenticated {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::UNAUTHORIZED,
            types::UNAUTHENTICATED,
            "Authentication required",
        )
        .with_detail(self.to_string())
        .into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Authenticated {
    type Rejection = Unauthenticated;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Principal>()
            .cloned()
            .map(Self)
            .ok_or(Unauthenticated)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for Authenticated {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Principal>().cloned().map(Self))
    }
}
