//! W3C trace context and OTLP span export (`--otlp-endpoint`, off by default).
//!
//! With an endpoint, each worker makes one span per client request it answers as the
//! edge (`mcpgw <method>`) and one per forwarded request it runs as the owner
//! (`mcpgw forwarded <method>`), children of the client's `traceparent` when it sent
//! one (a new trace otherwise), and passes its own span on as the parent: the owner
//! gets the edge's span in the mesh frame, the upstream the span of the worker that
//! called it. A client's unsampled `traceparent` (flags `00`) is passed on unchanged
//! and records nothing. Of the requests that start a trace here (no `traceparent`),
//! `--otlp-sample-ratio` of them are recorded, chosen by trace id; the others get an
//! unsampled `traceparent`, so that the owner and the upstream record nothing for them
//! either. Without an endpoint the gateway makes no spans and passes the client's
//! `traceparent` through as it came.
//!
//! Spans leave in batches (up to [`BATCH`], or every [`FLUSH_EVERY`]) as OTLP/HTTP JSON
//! to the collector's `/v1/traces` (`http://`, or `https://` with the platform's roots
//! or `--otlp-ca`), from a bounded queue: when the collector is slow or
//! gone, spans are dropped and counted, never waited for, so tracing cannot slow a
//! request down. Export failures are logged at most once a minute.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Request, Uri};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::warn;

use crate::config::Config;
use crate::digest::hex;

/// Spans per export request.
pub const BATCH: usize = 512;
/// Longest a finished span waits before it is sent.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Finished spans waiting to be sent; past it new ones are dropped (and counted).
const QUEUE: usize = 8192;
/// Deadline of one export request.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

const TRACEPARENT: &str = "traceparent";

/// A position in a trace: what a `traceparent` header carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl SpanContext {
    /// Reads a version-00 `traceparent`; `None` for anything else (which is then
    /// treated as absent, as the W3C recommendation says).
    pub fn parse(header: &str) -> Option<SpanContext> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() {
            return None;
        }
        let trace_id: [u8; 16] = hex_bytes(trace)?;
        let span_id: [u8; 8] = hex_bytes(span)?;
        let flags: [u8; 1] = hex_bytes(flags)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(SpanContext {
            trace_id,
            span_id,
            sampled: flags[0] & 1 == 1,
        })
    }

    /// Puts this span in `headers` as the `traceparent` of what the request reaches
    /// next.
    fn pass_on(&self, headers: &mut HeaderMap) {
        if let Ok(value) = HeaderValue::from_str(&self.traceparent()) {
            headers.insert(TRACEPARENT, value);
        }
    }

    /// The `traceparent` header naming this span as the parent.
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{}",
            hex(&self.trace_id),
            hex(&self.span_id),
            if self.sampled { "01" } else { "00" }
        )
    }
}

fn hex_bytes<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != N * 2 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[i * 2..i * 2 + 2], 16).ok()?;
    }
    Some(out)
}

fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    // A failing system RNG leaves zeros, which no collector accepts as an id; the
    // span is then dropped by `finish`, and the request is unaffected.
    let _ = getrandom::fill(&mut out);
    out
}

fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A span being timed. Made by [`Tracer::begin`], which already put its context in
/// the request's headers; ended by [`Tracer::finish`].
#[derive(Debug)]
pub struct ActiveSpan {
    context: SpanContext,
    parent: Option<[u8; 8]>,
    started: SystemTime,
}

/// What a finished span says besides its timing.
#[derive(Debug, Default)]
pub struct SpanFacts {
    pub name: String,
    pub attributes: Vec<(&'static str, Value)>,
    pub error: bool,
}

struct FinishedSpan {
    span: ActiveSpan,
    ended: SystemTime,
    facts: SpanFacts,
}

/// Makes and exports this worker's spans. Cheap to share.
pub struct Tracer {
    queue: mpsc::Sender<FinishedSpan>,
    dropped: Arc<AtomicU64>,
    roots: RootSampler,
}

/// Which of the traces that start here are recorded: a fixed fraction, chosen by the
/// trace id (as OpenTelemetry's trace-id ratio sampler does), so the choice is made
/// once, at the edge, and travels in the `traceparent`.
#[derive(Debug, Clone, Copy)]
struct RootSampler {
    every: bool,
    /// A trace is recorded when the low 64 bits of its id are below this.
    below: u64,
}

impl RootSampler {
    /// `ratio`: from 0.0 to 1.0 (checked by the configuration).
    fn new(ratio: f64) -> Self {
        Self {
            every: ratio >= 1.0,
            // Saturating: 1.0 × u64::MAX rounds up past it as an f64.
            below: (ratio.clamp(0.0, 1.0) * u64::MAX as f64) as u64,
        }
    }

    fn records(&self, trace_id: &[u8; 16]) -> bool {
        let mut low = [0u8; 8];
        low.copy_from_slice(&trace_id[8..]);
        self.every || u64::from_be_bytes(low) < self.below
    }
}

impl Tracer {
    /// Starts the exporter task for the configured collector (`otlp_endpoint`: an
    /// `http://` or `https://` URL, checked by the configuration; `otlp_ca`: the CAs of
    /// an `https://` one, else the platform's roots; `otlp_headers` on every export),
    /// recording `otlp_sample_ratio` of the traces that start here. `None` without an
    /// endpoint: no spans. Needs a tokio runtime.
    pub fn start(config: &Config, worker_id: &str) -> Result<Option<Tracer>, String> {
        let Some(endpoint) = config.otlp_endpoint.as_deref() else {
            return Ok(None);
        };
        let uri: Uri = endpoint
            .parse()
            .map_err(|_| format!("--otlp-endpoint {endpoint:?} is not a URL"))?;
        let https = uri.scheme_str() == Some("https");
        let collector = Collector {
            client: collector_client(https, config.otlp_ca.as_deref())?,
            uri,
            headers: config
                .otlp_headers
                .header_map()
                .map_err(|e| e.to_string())?,
        };
        let (queue, spans) = mpsc::channel(QUEUE);
        let dropped = Arc::new(AtomicU64::new(0));
        tokio::spawn(export(
            collector,
            worker_id.to_owned(),
            spans,
            dropped.clone(),
        ));
        Ok(Some(Tracer {
            queue,
            dropped,
            roots: RootSampler::new(config.otlp_sample_ratio),
        }))
    }

    /// Starts a span for a request whose headers are `headers`: a child of their
    /// sampled `traceparent`, or the root of a new trace. The request's `traceparent`
    /// is replaced by the new span's, so whatever the request reaches next (the owner,
    /// the upstream) is its child. `None` when the client's trace is not sampled, or a
    /// trace starting here is not among the recorded fraction (the request then
    /// carries an unsampled `traceparent`, so nothing after it records either).
    pub fn begin(&self, headers: &mut HeaderMap) -> Option<ActiveSpan> {
        let incoming = headers
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(SpanContext::parse);
        let (trace_id, parent) = match incoming {
            Some(context) if !context.sampled => return None,
            Some(context) => (context.trace_id, Some(context.span_id)),
            None => {
                let trace_id = random();
                if !self.roots.records(&trace_id) {
                    let unsampled = SpanContext {
                        trace_id,
                        span_id: random(),
                        sampled: false,
                    };
                    unsampled.pass_on(headers);
                    return None;
                }
                (trace_id, None)
            }
        };
        let context = SpanContext {
            trace_id,
            span_id: random(),
            sampled: true,
        };
        context.pass_on(headers);
        Some(ActiveSpan {
            context,
            parent,
            started: SystemTime::now(),
        })
    }

    /// Ends `span` now and queues it for export (dropped, and counted, when the queue
    /// is full).
    pub fn finish(&self, span: ActiveSpan, facts: SpanFacts) {
        let finished = FinishedSpan {
            span,
            ended: SystemTime::now(),
            facts,
        };
        if self.queue.try_send(finished).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

type CollectorClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Where spans go, and what every export request carries.
struct Collector {
    client: CollectorClient,
    uri: Uri,
    headers: HeaderMap,
}

/// The HTTP client that talks to the collector; TLS material is read only for an
/// `https://` one.
fn collector_client(https: bool, ca: Option<&Path>) -> Result<CollectorClient, String> {
    use crate::execute::upstream::tls;
    let trust = if https {
        tls::trusting(ca, "--otlp-ca")
    } else {
        // Plain http checks no certificate: no roots need to be found.
        tls::with_roots(rustls::RootCertStore::empty())
    };
    let config = trust
        .map_err(|e| format!("OTLP collector: {e}"))?
        .with_no_client_auth();
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(EXPORT_TIMEOUT));
    connector.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

/// Sends queued spans in batches until the tracer is dropped.
async fn export(
    collector: Collector,
    worker_id: String,
    mut spans: mpsc::Receiver<FinishedSpan>,
    dropped: Arc<AtomicU64>,
) {
    let resource = json!({"attributes": [
        attribute("service.name", json!("mcpgw")),
        attribute("service.instance.id", json!(worker_id)),
        attribute("service.version", json!(env!("CARGO_PKG_VERSION"))),
    ]});
    let mut failures = FailureLog::default();
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        let deadline = tokio::time::sleep(FLUSH_EVERY);
        tokio::pin!(deadline);
        let open = loop {
            tokio::select! {
                span = spans.recv() => match span {
                    Some(span) => {
                        batch.push(span_json(span));
                        if batch.len() >= BATCH {
                            break true;
                        }
                    }
                    None => break false,
                },
                () = &mut deadline => break true,
            }
        };
        if !batch.is_empty() {
            let body = json!({"resourceSpans": [{
                "resource": resource,
                "scopeSpans": [{
                    "scope": {"name": "mcpgw", "version": env!("CARGO_PKG_VERSION")},
                    "spans": std::mem::take(&mut batch),
                }],
            }]});
            let outcome = send(&collector, body.to_string()).await;
            failures.note(outcome, dropped.swap(0, Ordering::Relaxed));
        }
        if !open {
            return;
        }
    }
}

async fn send(collector: &Collector, body: String) -> Result<(), String> {
    let mut request = Request::post(collector.uri.clone())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    request.headers_mut().extend(collector.headers.clone());
    match tokio::time::timeout(EXPORT_TIMEOUT, collector.client.request(request)).await {
        Err(_) => Err(format!("no answer within {EXPORT_TIMEOUT:?}")),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(response)) if response.status().is_success() => Ok(()),
        Ok(Ok(response)) => Err(format!("answered {}", response.status())),
    }
}

/// Logs export failures and dropped spans at most once a minute.
#[derive(Default)]
struct FailureLog {
    last: Option<tokio::time::Instant>,
    failed_batches: u64,
    dropped: u64,
}

impl FailureLog {
    fn note(&mut self, outcome: Result<(), String>, dropped: u64) {
        self.dropped += dropped;
        let reason = match outcome {
            Ok(()) if self.dropped == 0 => return,
            Ok(()) => "the span queue was full".to_owned(),
            Err(reason) => {
                self.failed_batches += 1;
                reason
            }
        };
        let now = tokio::time::Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < Duration::from_secs(60))
        {
            return;
        }
        warn!(
            failed_batches = self.failed_batches,
            dropped_spans = self.dropped,
            %reason,
            "OTLP span export is failing: spans are being lost (requests are not affected)"
        );
        self.last = Some(now);
        self.failed_batches = 0;
        self.dropped = 0;
    }
}

fn attribute(key: &str, value: Value) -> Value {
    let value = match value {
        Value::Bool(b) => json!({"boolValue": b}),
        Value::Number(n) => match n.as_i64() {
            Some(i) => json!({"intValue": i.to_string()}),
            None => json!({"doubleValue": n.as_f64()}),
        },
        Value::String(s) => json!({"stringValue": s}),
        other => json!({"stringValue": other.to_string()}),
    };
    json!({"key": key, "value": value})
}

/// One span in OTLP/HTTP JSON (ids as hex, times as decimal strings, kind 2 = server).
fn span_json(finished: FinishedSpan) -> Value {
    let FinishedSpan { span, ended, facts } = finished;
    let mut out = json!({
        "traceId": hex(&span.context.trace_id),
        "spanId": hex(&span.context.span_id),
        "name": facts.name,
        "kind": 2,
        "startTimeUnixNano": unix_nanos(span.started).to_string(),
        "endTimeUnixNano": unix_nanos(ended).to_string(),
        "attributes": facts
            .attributes
            .into_iter()
            .map(|(key, value)| attribute(key, value))
            .collect::<Vec<_>>(),
        "status": {"code": if facts.error { 2 } else { 0 }},
    });
    if let Some(parent) = span.parent {
        out["parentSpanId"] = json!(hex(&parent));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tracer's configuration whose collector nobody listens at.
    fn to_nowhere(sample_ratio: f64) -> Config {
        Config {
            otlp_endpoint: Some("http://127.0.0.1:9/v1/traces".into()),
            otlp_sample_ratio: sample_ratio,
            ..Config::default()
        }
    }

    #[test]
    fn traceparents_are_read_strictly_and_written_back() {
        let text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = SpanContext::parse(text).expect("valid");
        assert!(context.sampled);
        assert_eq!(context.traceparent(), text);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(SpanContext::parse(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_span_continues_a_sampled_trace_and_skips_an_unsampled_one() {
        let tracer = Tracer::start(&to_nowhere(1.0), "w")
            .expect("tracer")
            .expect("an endpoint");
        let mut headers = HeaderMap::new();
        let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        headers.insert(TRACEPARENT, HeaderValue::from_static(incoming));
        let span = tracer.begin(&mut headers).expect("sampled");
        let passed_on = SpanContext::parse(headers[TRACEPARENT].to_str().unwrap()).unwrap();
        assert_eq!(hex(&passed_on.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(passed_on.span_id, span.context.span_id);
        assert_eq!(
            span.parent.map(|p| hex(&p)).as_deref(),
            Some("00f067aa0ba902b7")
        );

        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        headers.insert(TRACEPARENT, HeaderValue::from_static(unsampled));
        assert!(tracer.begin(&mut headers).is_none());
        assert_eq!(headers[TRACEPARENT], unsampled, "passed on unchanged");

        headers.remove(TRACEPARENT);
        let root = tracer.begin(&mut headers).expect("a new trace");
        assert_eq!(root.parent, None);
        assert!(headers.contains_key(TRACEPARENT));
    }

    #[tokio::test]
    async fn new_traces_are_recorded_at_the_configured_ratio_and_parents_decide_their_own() {
        let none = Tracer::start(&to_nowhere(0.0), "w")
            .expect("tracer")
            .expect("an endpoint");
        let mut headers = HeaderMap::new();
        assert!(none.begin(&mut headers).is_none(), "no new trace recorded");
        let passed_on = SpanContext::parse(headers[TRACEPARENT].to_str().unwrap()).unwrap();
        assert!(
            !passed_on.sampled,
            "the owner and the upstream are told not to record it either"
        );
        // A client's sampled trace is recorded whatever the ratio.
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        headers.insert(TRACEPARENT, HeaderValue::from_static(sampled));
        assert!(none.begin(&mut headers).is_some());

        let half = Tracer::start(&to_nowhere(0.5), "w")
            .expect("tracer")
            .expect("an endpoint");
        let recorded = (0..4000)
            .filter(|_| half.begin(&mut HeaderMap::new()).is_some())
            .count();
        assert!((1600..=2400).contains(&recorded), "{recorded} of 4000");

        // The choice follows the trace id, so every worker of a trace agrees.
        let every = RootSampler::new(1.0);
        let quarter = RootSampler::new(0.25);
        let low = [0u8; 16];
        let high = [0xffu8; 16];
        assert!(every.records(&low) && every.records(&high));
        assert!(quarter.records(&low) && !quarter.records(&high));
        assert!(!RootSampler::new(0.0).records(&low));
    }
}
