//! The consumer loop's own errors (a broker that failed, a configuration it refused).

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a consumer loop stopped. Messages in hand were not acknowledged, so the broker
/// redelivers them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The configuration is unusable.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// The broker could not be reached (refused, unreachable, bad credentials).
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
}
