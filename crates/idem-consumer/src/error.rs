//! The consumer loop's own errors (a broker that failed, a configuration it refused).

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Whether a broker client's error is the broker refusing the credentials, decided by the
/// broker's own code: AMQP reply code 403 (`ACCESS_REFUSED`) as the connection opens;
/// NATS's authorization violation, or a failed authentication (a nonce that could not be
/// signed, a credentials file that could not be used).
#[cfg_attr(not(any(feature = "amqp", feature = "nats")), allow(unused_variables))]
pub(crate) fn refused_credentials(source: &(dyn std::error::Error + 'static)) -> bool {
    #[cfg(feature = "amqp")]
    if let Some(e) = source.downcast_ref::<lapin::Error>() {
        return matches!(e.kind(), lapin::ErrorKind::ProtocolError(p) if p.get_id() == 403);
    }
    #[cfg(feature = "nats")]
    if let Some(e) = source.downcast_ref::<async_nats::ConnectError>() {
        return matches!(
            e.kind(),
            async_nats::ConnectErrorKind::AuthorizationViolation
                | async_nats::ConnectErrorKind::Authentication
        );
    }
    false
}

/// Why a consumer loop stopped. Messages in hand were not acknowledged, so the broker
/// redelivers them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The configuration is unusable.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// The broker could not be reached (refused, unreachable, bad credentials:
    /// [`ConsumerError::is_authentication`] tells the last apart).
    #[error("{broker}: cannot connect to {target}: {source}")]
    Connect {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// The URL, password redacted.
        target: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// The broker refused an operation or the connection to it failed.
    #[error("{broker}: cannot {action}: {source}")]
    Broker {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// What the consumer was doing.
        action: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

impl ConsumerError {
    /// A broker error while doing `action`.
    pub fn broker(
        broker: &'static str,
        action: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Broker {
            broker,
            action: action.into(),
            source: source.into(),
        }
    }

    /// `true` for a [`ConsumerError::Connect`] in which the broker refused the
    /// credentials (AMQP 403 `ACCESS_REFUSED`, NATS authorization violation): a retry
    /// with the same URL fails the same way.
    pub fn is_authentication(&self) -> bool {
        matches!(self, Self::Connect { source, .. } if refused_credentials(source.as_ref()))
    }
}
