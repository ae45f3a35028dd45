//! Redis connection plumbing shared by the directory and the Redis baseline transport:
//! opening a client from a URL, waiting for a Redis that is still starting, building
//! the self-reconnecting connection manager, and keeping passwords out of every text
//! that leaves this crate.
//!
//! Both users need the same guarantees: an unparsable URL is reported without quoting
//! it (the parse error may echo a password), every error text is scrubbed of the
//! password, and a first connection is bounded by a deadline.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;
use redis::{IntoConnectionInfo, ProtocolVersion};
use tokio::time::{Instant, sleep, timeout_at};

/// Pause between attempts of a first connection to a Redis that is not answering yet.
const CONNECT_RETRY: Duration = Duration::from_millis(100);

/// A Redis client for `url`, with `tcp` socket settings when given.
///
/// The error says that the URL does not parse, with the URL redacted: redis-rs's own
/// parse error may quote it, password included, so it is not passed on.
pub(crate) fn open_client(url: &str, tcp: Option<TcpSettings>) -> Result<redis::Client, String> {
    let unparsable = |_| {
        format!(
            "Redis URL {} does not parse: expected redis://[user:password@]host:port[/db]",
            redact_url(url)
        )
    };
    let info = url.into_connection_info().map_err(unparsable)?;
    let info = match tcp {
        Some(tcp) => info.set_tcp_settings(tcp),
        None => info,
    };
    redis::Client::open(info).map_err(unparsable)
}

/// The same client speaking `protocol` (RESP2 or RESP3).
pub(crate) fn with_protocol(
    client: &redis::Client,
    protocol: ProtocolVersion,
) -> Result<redis::Client, String> {
    let info = client.get_connection_info().clone();
    let settings = info.redis_settings().clone().set_protocol(protocol);
    redis::Client::open(info.set_redis_settings(settings))
        .map_err(|e| scrub(&e.to_string(), password(client).as_deref()))
}

/// The client's decoded password, to scrub from error texts; `None` without one.
pub(crate) fn password(client: &redis::Client) -> Option<String> {
    client
        .get_connection_info()
        .redis_settings()
        .password()
        .map(str::to_owned)
}

/// Tries direct connections and a `PING` until one answers or `deadline` passes, so a
/// Redis that is still starting is waited for, and a failure reports its real cause
/// (refused, wrong password) rather than a generic retry exhaustion. `op_timeout`
/// bounds each attempt's connect and answer. A failure that waiting cannot fix (bad
/// credentials, a refused command) ends the wait at once. The error is scrubbed.
pub(crate) async fn wait_until_answering(
    client: &redis::Client,
    op_timeout: Duration,
    deadline: Instant,
    no_answer: &str,
) -> Result<(), String> {
    let probe_cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(op_timeout))
        .set_response_timeout(Some(op_timeout));
    let secret = password(client);
    let mut last_error = no_answer.to_owned();
    loop {
        let probe = async {
            let mut c = client
                .get_multiplexed_async_connection_with_config(&probe_cfg)
                .await?;
            redis::cmd("PING").query_async::<String>(&mut c).await
        };
        match timeout_at(deadline, probe).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => {
                last_error = scrub(&e.to_string(), secret.as_deref());
                // Waiting does not fix credentials or a refused command.
                let permanent = e.kind() == redis::ErrorKind::AuthenticationFailed
                    || matches!(e.kind(), redis::ErrorKind::Server(_))
                        && matches!(e.retry_method(), redis::RetryMethod::NoRetry);
                if permanent {
                    return Err(last_error);
                }
            }
            Err(_) => return Err(last_error),
        }
        if Instant::now() + CONNECT_RETRY >= deadline {
            return Err(last_error);
        }
        sleep(CONNECT_RETRY).await;
    }
}

/// Why [`connect_manager`] failed.
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// Redis refused or the connection broke; the scrubbed reason.
    Failed(String),
    /// No connection by the deadline.
    TimedOut,
}

/// Builds the self-reconnecting, multiplexed connection manager, giving up at
/// `deadline`.
pub(crate) async fn connect_manager(
    client: &redis::Client,
    config: ConnectionManagerConfig,
    deadline: Instant,
) -> Result<ConnectionManager, ConnectFailure> {
    let manager = ConnectionManager::new_with_config(client.clone(), config);
    match timeout_at(deadline, manager).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(ConnectFailure::Failed(scrub(
            &e.to_string(),
            password(client).as_deref(),
        ))),
        Err(_) => Err(ConnectFailure::TimedOut),
    }
}

/// Removes a password from a text, in case an error echoes it.
pub(crate) fn scrub(text: &str, password: Option<&str>) -> String {
    match password {
        Some(p) if !p.is_empty() => text.replace(p, "***"),
        _ => text.to_owned(),
    }
}

/// The URL without credentials: userinfo becomes `***`, and the query (which may carry
/// a password for unix-socket URLs) is dropped.
pub fn redact_url(url: &str) -> String {
    let url = url.split(['?', '#']).next().unwrap_or("");
    let Some((scheme, rest)) = url.split_once("://") else {
        // Not a URL we understand; do not risk echoing a secret.
        return "<redis url>".into();
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{path}"),
        None => format!("{scheme}://{authority}{path}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials() {
        assert_eq!(
            redact_url("redis://user:s3cret@redis.internal:6380/2"),
            "redis://***@redis.internal:6380/2"
        );
        assert_eq!(redact_url("redis://:p@ss@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?pass=s3cret"),
            "redis+unix:///run/redis.sock"
        );
        assert_eq!(redact_url("s3cret"), "<redis url>");
    }

    #[test]
    fn passwords_are_scrubbed() {
        assert_eq!(
            scrub("auth s3cret failed", Some("s3cret")),
            "auth *** failed"
        );
        assert_eq!(scrub("no secret here", Some("")), "no secret here");
        assert_eq!(scrub("no secret here", None), "no secret here");
    }

    #[test]
    fn an_unparsable_url_is_not_quoted() {
        let err = open_client("redis://u:s3cret@[bad", None).expect_err("does not parse");
        assert!(!err.contains("s3cret"), "{err}");
        assert!(err.contains("does not parse"), "{err}");
    }

    #[test]
    fn the_password_is_found_for_scrubbing() {
        let client = open_client("redis://u:s3cret@127.0.0.1:1", None).expect("parses");
        assert_eq!(password(&client).as_deref(), Some("s3cret"));
    }
}
