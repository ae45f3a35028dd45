//! Streamable HTTP upstreams (`http://` and `https://`) over a pooled HTTP/1.1 client:
//! one keep-alive pool per upstream, shared by all its sessions.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;

use super::{UpstreamError, UpstreamReply, UpstreamRequest, tls};
use crate::config::UpstreamTls;

pub struct HttpUpstream {
    name: String,
    uri: Uri,
    connect_timeout: Duration,
    /// Shared keep-alive pool: one upstream session does not need its own connection.
    client: Pool,
}

/// The pool of one upstream: plain TCP, or TCP with rustls on top.
enum Pool {
    Plain(Client<HttpConnector, Full<Bytes>>),
    Tls(Client<HttpsConnector<HttpConnector>, Full<Bytes>>),
}

impl Pool {
    fn request(&self, request: Request<Full<Bytes>>) -> ResponseFuture {
        match self {
            Pool::Plain(client) => client.request(request),
            Pool::Tls(client) => client.request(request),
        }
    }
}

impl HttpUpstream {
    pub fn new(
        name: &str,
        url: &str,
        tls: &UpstreamTls,
        connect_timeout: Duration,
    ) -> Result<Self, UpstreamError> {
        let uri: Uri = url.parse().map_err(|_| UpstreamError::Unreachable {
            name: name.to_owned(),
            detail: format!("{url:?} is not a valid URL"),
        })?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024);
        let client = if uri.scheme_str() == Some("https") {
            let config = tls::client_config(name, tls).map_err(UpstreamError::Config)?;
            connector.enforce_http(false);
            let https = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config((*config).clone())
                .https_only()
                .enable_http1()
                .wrap_connector(connector);
            Pool::Tls(builder.build(https))
        } else {
            Pool::Plain(builder.build(connector))
        };
        Ok(Self {
            name: name.to_owned(),
            uri,
            connect_timeout,
            client,
        })
    }

    pub async fn send(&self, request: UpstreamRequest) -> Result<UpstreamReply, UpstreamError> {
        let mut builder = Request::builder()
            .method(request.method)
            .uri(self.uri.clone());
        if let Some(headers) = builder.headers_mut() {
            *headers = request.headers;
        }
        let http_request = builder
            .body(Full::new(request.body))
            .map_err(|e| self.failed(e.to_string()))?;
        let response = tokio::time::timeout(request.timeout, self.client.request(http_request))
            .await
            .map_err(|_| UpstreamError::Timeout {
                name: self.name.clone(),
                timeout: request.timeout,
            })?
            .map_err(|e| {
                let detail = error_chain(&e);
                if let Some(tls) = tls::find_tls_error(&e) {
                    UpstreamError::Tls {
                        name: self.name.clone(),
                        detail: tls::explain(tls),
                    }
                } else if e.is_connect() && timed_out(&e) {
                    // The connector's own deadline: slow, not refused.
                    UpstreamError::Timeout {
                        name: self.name.clone(),
                        timeout: self.connect_timeout,
                    }
                } else if e.is_connect() {
                    UpstreamError::Unreachable {
                        name: self.name.clone(),
                        detail,
                    }
                } else {
                    self.failed(detail)
                }
            })?;
        let (parts, body) = response.into_parts();
        Ok(UpstreamReply {
            status: parts.status,
            headers: parts.headers,
            body: body.map_err(Into::into).boxed_unsync(),
        })
    }

    fn failed(&self, detail: String) -> UpstreamError {
        UpstreamError::Failed {
            name: self.name.clone(),
            detail,
        }
    }
}

/// Whether any cause in the chain is an I/O timeout (the connector's deadline).
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        current = e.source();
    }
    false
}

/// The error and its causes in one line: hyper's top-level messages alone are vague.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("tcp connect error")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_connect_deadline_anywhere_in_the_chain_is_a_timeout() {
        let slow = Outer(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "deadline has elapsed",
        ));
        let refused = Outer(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(timed_out(&slow));
        assert!(!timed_out(&refused));
        assert_eq!(
            error_chain(&slow),
            "tcp connect error: deadline has elapsed"
        );
    }
}
