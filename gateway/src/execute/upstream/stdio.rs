//! stdio upstreams: one child process per session, spoken to in newline-delimited
//! JSON-RPC over its stdin and stdout (the MCP stdio transport), its stderr logged.
//!
//! A Streamable HTTP exchange maps onto the conversation like this: a POSTed request
//! is written to stdin, and the child's lines for it come back as the POST's answer:
//! plain JSON when the response is the first thing it writes, else an SSE stream of
//! everything it writes for the request until the response. A POSTed notification or
//! response (the client answering an elicitation, say) is written and answered 202.
//! What the child writes outside any request goes to the session's `GET` stream.
//!
//! Children die with their worker, also when it is killed with SIGKILL: each child is
//! started through `mcpgw stdio-exec` ([`exec_child`]), which asks the kernel to kill
//! it when its parent goes (`PR_SET_PDEATHSIG`) and then executes the command in its
//! place. The kernel's "parent" is the *thread* that forked the child, so children are
//! forked by one long-lived thread of their own ([`spawn_thread`]), never by a tokio
//! worker thread that might exit on its own. This needs no `unsafe` (no `pre_exec`).
//! Each child leads its own process group, so ending a session also ends the helper
//! processes the server started.

use std::collections::HashMap;
use std::process::{ExitCode, ExitStatus, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};
use tracing::{debug, info, warn};

use super::conversation::{Answer, Conversation, Route};
use super::{UpstreamError, UpstreamReply};
use crate::body::{self, BoxError};
use crate::config::StdioCommand;
use crate::digest::SessionTag;
use crate::execute::streams::StreamLog;

/// The hidden subcommand that starts a child: `mcpgw stdio-exec -- PROGRAM ARG…`.
pub const EXEC_SUBCOMMAND: &str = "stdio-exec";
/// Tells [`exec_child`] which process must still be its parent.
const ENV_PARENT_PID: &str = "MCPGW_STDIO_PARENT_PID";
/// Longest line a child may write on stdout; a longer one ends its session.
const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// Longest stderr line logged whole.
const MAX_LOG_LINE: usize = 8 * 1024;
/// How long a child may take to exit after its stdin closes, then after SIGTERM.
const EXIT_GRACE: Duration = Duration::from_secs(1);
/// How long a write that found the child's stdin closed waits for its exit status.
const EXIT_STATUS_WAIT: Duration = Duration::from_millis(500);

/// A configured stdio upstream: what to run, and how many of it run here.
pub struct StdioUpstream {
    name: String,
    command: StdioCommand,
    /// Children of this upstream alive in this worker, in all and per principal.
    running: Arc<Mutex<ProcessCounts>>,
}

impl StdioUpstream {
    pub fn new(name: &str, command: StdioCommand) -> StdioUpstream {
        StdioUpstream {
            name: name.to_owned(),
            command,
            running: Arc::default(),
        }
    }

    /// Starts the child of one session. `tag` labels its log lines (a short hash of the
    /// session id, never the id); `principal` is the quota key the child counts
    /// against (see [`crate::auth::Authenticator::quota_key`]; `None`: only the upstream's
    /// limit); what it writes outside any request goes to `unsolicited`; `on_exit`
    /// hears once why it stopped.
    pub async fn start(
        &self,
        tag: SessionTag,
        principal: Option<&str>,
        unsolicited: Arc<StreamLog>,
        on_exit: Box<dyn FnOnce(String) + Send>,
    ) -> Result<Arc<StdioProcess>, UpstreamError> {
        let slot = ProcessSlot::take(
            &self.running,
            self.command.max_processes,
            principal.map(|key| (key, self.command.max_processes_per_principal)),
        )
        .map_err(|full| match full {
            Full::Upstream => UpstreamError::ProcessLimit {
                name: self.name.clone(),
                max: self.command.max_processes,
            },
            Full::Principal => UpstreamError::ProcessQuota {
                name: self.name.clone(),
                max: self.command.max_processes_per_principal,
                scope: principal
                    .filter(|key| key.starts_with("addr:"))
                    .map_or("principal", |_| "client address"),
            },
        })?;
        let spawn_error = |detail| UpstreamError::Spawn {
            name: self.name.clone(),
            detail,
        };
        check_program(&self.command).map_err(spawn_error)?;
        let mut child = spawn(self.command_line()).await.map_err(spawn_error)?;
        let pid = child.id().unwrap_or(0);
        let spawn_failed = |what: &str| UpstreamError::Spawn {
            name: self.name.clone(),
            detail: format!("its {what} is not a pipe"),
        };
        let stdin = child.stdin.take().ok_or_else(|| spawn_failed("stdin"))?;
        let stdout = child.stdout.take().ok_or_else(|| spawn_failed("stdout"))?;
        let stderr = child.stderr.take().ok_or_else(|| spawn_failed("stderr"))?;
        let conversation = Arc::new(Mutex::new(Conversation::default()));
        let (stop_tx, stop_rx) = oneshot::channel();
        let (output_done_tx, output_done_rx) = oneshot::channel();
        let (exited_tx, exited) = watch::channel(None);
        tokio::spawn(log_stderr(stderr, self.name.clone(), tag));
        tokio::spawn(read_stdout(
            stdout,
            Arc::clone(&conversation),
            unsolicited,
            self.name.clone(),
            tag,
            output_done_tx,
        ));
        tokio::spawn(keep(Keeper {
            child,
            pid,
            stop: stop_rx,
            output_done: output_done_rx,
            conversation: Arc::clone(&conversation),
            exited: exited_tx,
            on_exit,
            slot,
            lifetime: self.command.max_session_lifetime,
        }));
        debug!(upstream = %self.name, session = %tag, pid, "stdio upstream started");
        Ok(Arc::new(StdioProcess {
            name: self.name.clone(),
            pid,
            conversation,
            stdin: tokio::sync::Mutex::new(Some(stdin)),
            stop: Mutex::new(Some(stop_tx)),
            exited,
        }))
    }

    /// The child's command: this binary's `stdio-exec`, which becomes the program.
    fn command_line(&self) -> Command {
        let mut command = Command::new("/proc/self/exe");
        command
            .arg(EXEC_SUBCOMMAND)
            .arg("--")
            .arg(&self.command.program)
            .args(&self.command.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        // The gateway's own variables hold its configuration (Redis URLs, paths):
        // they are not the child's business.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("MCPGW_") {
                command.env_remove(name);
            }
        }
        command.env(ENV_PARENT_PID, std::process::id().to_string());
        command.envs(&self.command.env);
        if let Some(cwd) = &self.command.cwd {
            command.current_dir(cwd);
        }
        command
    }
}

/// Whether the program of `command` can be executed: a path must name an executable
/// file (relative to the child's working directory), a bare name must be one on the
/// child's `PATH`. The child itself is `mcpgw stdio-exec`, which always starts, so
/// without this check a command that cannot start would look like a server that
/// exited with status 127.
fn check_program(command: &StdioCommand) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    let executable = |path: &Path| {
        path.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let program = &command.program;
    if program.contains('/') {
        let path = match &command.cwd {
            Some(cwd) => cwd.join(program),
            None => Path::new(program).to_path_buf(),
        };
        return if executable(&path) {
            Ok(())
        } else {
            Err(format!("{program} is not an executable file"))
        };
    }
    let search = command
        .env
        .get("PATH")
        .cloned()
        .or_else(|| std::env::var("PATH").ok())
        .unwrap_or_else(|| "/bin:/usr/bin".to_owned());
    if std::env::split_paths(&search).any(|dir| executable(&dir.join(program))) {
        Ok(())
    } else {
        Err(format!("{program} is not found on PATH ({search})"))
    }
}

/// Living children of one upstream in this worker.
#[derive(Default)]
struct ProcessCounts {
    all: usize,
    /// By quota key; a key leaves the map with its last child.
    per_principal: HashMap<String, usize>,
}

/// Which limit a child would pass.
#[derive(Debug, PartialEq, Eq)]
enum Full {
    Upstream,
    Principal,
}

/// One place in an upstream's process limits, given back when the child is gone.
struct ProcessSlot {
    counts: Arc<Mutex<ProcessCounts>>,
    principal: Option<String>,
}

impl ProcessSlot {
    /// A place within `max` children in all and, for a principal, within its own
    /// maximum. Only keys that name someone (`principal:…`, `addr:…`) have one: the
    /// catch-all key of clients without an address would make them all share it.
    fn take(
        counts: &Arc<Mutex<ProcessCounts>>,
        max: usize,
        principal: Option<(&str, usize)>,
    ) -> Result<ProcessSlot, Full> {
        let principal =
            principal.filter(|(key, _)| key.starts_with("principal:") || key.starts_with("addr:"));
        let mut guard = counts.lock();
        if let Some((key, own_max)) = principal
            && guard.per_principal.get(key).copied().unwrap_or(0) >= own_max
        {
            return Err(Full::Principal);
        }
        if guard.all >= max {
            return Err(Full::Upstream);
        }
        guard.all += 1;
        if let Some((key, _)) = principal {
            *guard.per_principal.entry(key.to_owned()).or_default() += 1;
        }
        Ok(ProcessSlot {
            counts: Arc::clone(counts),
            principal: principal.map(|(key, _)| key.to_owned()),
        })
    }
}

impl Drop for ProcessSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock();
        counts.all = counts.all.saturating_sub(1);
        if let Some(key) = &self.principal
            && let Some(n) = counts.per_principal.get_mut(key)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.per_principal.remove(key);
            }
        }
    }
}

/// The child process of one session.
pub struct StdioProcess {
    name: String,
    pid: u32,
    conversation: Arc<Mutex<Conversation>>,
    /// Taken (closed) when the session ends: a well-behaved server exits on EOF.
    stdin: tokio::sync::Mutex<Option<ChildStdin>>,
    /// Tells the keeper to end the child; dropping it does too.
    stop: Mutex<Option<oneshot::Sender<()>>>,
    /// Why the child stopped, once it has.
    exited: watch::Receiver<Option<String>>,
}

impl StdioProcess {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Why the child stopped, if it has.
    pub fn exit_reason(&self) -> Option<String> {
        self.exited.borrow().clone()
    }

    /// One POSTed message. A request is answered with JSON when the child's first
    /// line for it is the response, else with an SSE stream of its lines up to the
    /// response; anything else is written and answered 202.
    pub async fn exchange(
        self: &Arc<Self>,
        body: &[u8],
        accepts_json: bool,
        timeout: Duration,
    ) -> Result<UpstreamReply, UpstreamError> {
        let Ok(Value::Object(message)) = serde_json::from_slice::<Value>(body) else {
            return Err(self.failed("the message is not a JSON-RPC object".into()));
        };
        let is_request = message.contains_key("method") && message.contains_key("id");
        if !is_request {
            return self.pass_on(message, timeout).await;
        }
        let (first, answers) = self.send_request(message, timeout).await?;
        Ok(match first {
            Answer::Final(json) if accepts_json => json_reply(json),
            first => sse_reply(first, answers),
        })
    }

    /// A notification or a response: nothing comes back for it, so it is answered
    /// 202 once written.
    async fn pass_on(
        &self,
        message: serde_json::Map<String, Value>,
        timeout: Duration,
    ) -> Result<UpstreamReply, UpstreamError> {
        let line = {
            let mut conversation = self.conversation.lock();
            self.check_open(&conversation)?;
            conversation.other(message)
        };
        if let Some(line) = line {
            self.write(&line, timeout).await?;
        }
        Ok(UpstreamReply {
            status: StatusCode::ACCEPTED,
            headers: HeaderMap::new(),
            body: body::full(Bytes::new()),
        })
    }

    /// Writes a request and waits for the child's first line about it; the rest
    /// follow on the receiver returned with it.
    async fn send_request(
        self: &Arc<Self>,
        message: serde_json::Map<String, Value>,
        timeout: Duration,
    ) -> Result<(Answer, mpsc::UnboundedReceiver<Answer>), UpstreamError> {
        let (sink, mut answers) = mpsc::unbounded_channel();
        let (id, line) = {
            let mut conversation = self.conversation.lock();
            self.check_open(&conversation)?;
            conversation.request(message, sink)
        };
        let mut unanswered = CancelIfDropped {
            process: Arc::clone(self),
            id,
            timeout,
            armed: true,
        };
        let first = tokio::time::timeout(timeout, async {
            self.write(&line, timeout).await?;
            Ok::<_, UpstreamError>(answers.recv().await)
        })
        .await;
        unanswered.armed = false;
        let first = self.first_answer(id, timeout, first)?;
        Ok((first, answers))
    }

    /// The first answer to request `id`, or why there is none.
    fn first_answer(
        &self,
        id: u64,
        timeout: Duration,
        first: Result<Result<Option<Answer>, UpstreamError>, tokio::time::error::Elapsed>,
    ) -> Result<Answer, UpstreamError> {
        match first {
            // The line was written, then the child ended before any answer: it may have
            // read and run it. (A write that fails finds it gone first: `Exited` below.)
            Ok(Ok(Some(Answer::Ended { why, .. }))) => Err(UpstreamError::ExitedWhileRunning {
                name: self.name.clone(),
                detail: why,
            }),
            Ok(Ok(Some(first))) => Ok(first),
            Ok(Ok(None)) if self.conversation.lock().closed().is_none() => {
                Err(self.failed("the request was cancelled before the server answered it".into()))
            }
            Ok(Ok(None)) => Err(match self.exited() {
                UpstreamError::Exited { name, detail } => {
                    UpstreamError::ExitedWhileRunning { name, detail }
                }
                other => other,
            }),
            Ok(Err(e)) => {
                self.conversation.lock().abandon(id);
                Err(e)
            }
            Err(_) => {
                self.conversation.lock().abandon(id);
                Err(UpstreamError::Timeout {
                    name: self.name.clone(),
                    timeout,
                })
            }
        }
    }

    /// Ends the child: closes its stdin, then SIGTERM and SIGKILL to its process group
    /// if it does not exit by itself. Returns once it is gone.
    pub async fn stop(&self) {
        self.stdin.lock().await.take();
        if let Some(stop) = self.stop.lock().take() {
            let _ = stop.send(());
        }
        let mut exited = self.exited.clone();
        let _ = exited.wait_for(|why| why.is_some()).await;
    }

    fn check_open(&self, conversation: &Conversation) -> Result<(), UpstreamError> {
        match conversation.closed() {
            Some(why) => Err(UpstreamError::Exited {
                name: self.name.clone(),
                detail: why.to_owned(),
            }),
            None => Ok(()),
        }
    }

    async fn write(&self, line: &[u8], timeout: Duration) -> Result<(), UpstreamError> {
        let mut stdin = self.stdin.lock().await;
        let Some(pipe) = stdin.as_mut() else {
            return Err(self.exited());
        };
        let written = tokio::time::timeout(timeout, async {
            pipe.write_all(line).await?;
            pipe.flush().await
        })
        .await;
        match written {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(self.exited_after_broken_pipe().await),
            Err(_) => Err(self.failed(format!("it did not read its input within {timeout:?}"))),
        }
    }

    /// A pipe that broke under a write usually means the child died, and its exit
    /// status comes a moment after: waiting for it (briefly) tells the client how it
    /// ended ("killed by signal 9") instead of only that it stopped reading.
    async fn exited_after_broken_pipe(&self) -> UpstreamError {
        let mut exited = self.exited.clone();
        let _ = tokio::time::timeout(EXIT_STATUS_WAIT, exited.wait_for(|why| why.is_some())).await;
        self.exited()
    }

    fn exited(&self) -> UpstreamError {
        UpstreamError::Exited {
            name: self.name.clone(),
            detail: self
                .exit_reason()
                .or_else(|| self.conversation.lock().closed().map(str::to_owned))
                .unwrap_or_else(|| "stopped reading its input".into()),
        }
    }

    fn failed(&self, detail: String) -> UpstreamError {
        UpstreamError::Failed {
            name: self.name.clone(),
            detail,
        }
    }
}

/// A request whose client went away before its first answer (the connection dropped,
/// and with it the exchange waiting here) is cancelled at the child, as dropping the
/// request cancels it at an HTTP upstream: the gateway forgets it and sends the child
/// `notifications/cancelled`. A request answered by a stream is not: its stream is
/// read on for the client to resume.
struct CancelIfDropped {
    process: Arc<StdioProcess>,
    /// The id the child knows the request by.
    id: u64,
    timeout: Duration,
    /// Disarmed once the exchange has its first answer (or its own error).
    armed: bool,
}

impl Drop for CancelIfDropped {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.process.conversation.lock().abandon(self.id);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let cancel = serde_json::json!({
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": { "requestId": self.id, "reason": "the client went away" },
        });
        let mut line = cancel.to_string().into_bytes();
        line.push(b'\n');
        let (process, timeout) = (Arc::clone(&self.process), self.timeout);
        runtime.spawn(async move {
            // A child that is gone needs no cancellation.
            let _ = process.write(&line, timeout).await;
        });
    }
}

fn json_reply(json: Bytes) -> UpstreamReply {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    UpstreamReply {
        status: StatusCode::OK,
        headers,
        body: body::full(json),
    }
}

/// The request's messages as an SSE stream that ends after the response.
fn sse_reply(first: Answer, rest: mpsc::UnboundedReceiver<Answer>) -> UpstreamReply {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    let later = futures_util::stream::unfold(rest, |mut rest| async move {
        rest.recv().await.map(|answer| (answer, rest))
    });
    let answers = futures_util::stream::once(async move { first }).chain(later);
    // Stop after the response: the channel may stay open a moment longer.
    let events = answers
        .scan(false, |done, answer| {
            if *done {
                return std::future::ready(None);
            }
            let json = match answer {
                Answer::Interim(json) => json,
                Answer::Final(json) | Answer::Ended { error: json, .. } => {
                    *done = true;
                    json
                }
            };
            let mut event = Vec::with_capacity(json.len() + 24);
            event.extend_from_slice(b"event: message\ndata: ");
            event.extend_from_slice(&json);
            event.extend_from_slice(b"\n\n");
            std::future::ready(Some(Ok::<_, BoxError>(Frame::data(Bytes::from(event)))))
        })
        .boxed();
    UpstreamReply {
        status: StatusCode::OK,
        headers,
        body: StreamBody::new(events).boxed_unsync(),
    }
}

/// Reads the child's stdout and routes each line; tells the keeper when it ends.
async fn read_stdout(
    stdout: tokio::process::ChildStdout,
    conversation: Arc<Mutex<Conversation>>,
    unsolicited: Arc<StreamLog>,
    name: String,
    tag: SessionTag,
    done: oneshot::Sender<String>,
) {
    let mut lines = FramedRead::new(stdout, LinesCodec::new_with_max_length(MAX_MESSAGE_BYTES));
    let why = loop {
        match lines.next().await {
            Some(Ok(line)) => {
                if line.trim().is_empty() {
                    continue;
                }
                let route = conversation.lock().incoming(line.as_bytes());
                match route {
                    Route::Request(sink, answer) => {
                        // The client of that request may be gone; the answer is moot then.
                        let _ = sink.send(answer);
                    }
                    Route::Unsolicited(json) => unsolicited.push_message(&json),
                    Route::Dropped(what) => {
                        warn!(upstream = %name, session = %tag, "stdio upstream wrote {what}; ignored")
                    }
                }
            }
            Some(Err(LinesCodecError::MaxLineLengthExceeded)) => {
                break format!("wrote a message longer than {MAX_MESSAGE_BYTES} bytes");
            }
            Some(Err(LinesCodecError::Io(e))) => break format!("output failed: {e}"),
            None => break "closed its output".to_owned(),
        }
    };
    let _ = done.send(why);
}

async fn log_stderr(stderr: tokio::process::ChildStderr, name: String, tag: SessionTag) {
    let mut lines = FramedRead::new(stderr, LinesCodec::new_with_max_length(MAX_LOG_LINE));
    while let Some(line) = lines.next().await {
        match line {
            Ok(line) => info!(target: "mcpgw::stdio", upstream = %name, session = %tag, "{line}"),
            Err(LinesCodecError::MaxLineLengthExceeded) => info!(
                target: "mcpgw::stdio", upstream = %name, session = %tag,
                "(a stderr line longer than {MAX_LOG_LINE} bytes was skipped)"
            ),
            Err(LinesCodecError::Io(_)) => break,
        }
    }
}

/// What the keeper task owns: the child itself, and what it tells when it stops.
struct Keeper {
    child: Child,
    pid: u32,
    stop: oneshot::Receiver<()>,
    output_done: oneshot::Receiver<String>,
    conversation: Arc<Mutex<Conversation>>,
    exited: watch::Sender<Option<String>>,
    on_exit: Box<dyn FnOnce(String) + Send>,
    /// Held until the child is gone, so the limit counts living children.
    slot: ProcessSlot,
    /// The session's maximum lifetime (`max_session_lifetime_ms`), if it has one.
    lifetime: Option<Duration>,
}

/// Waits for the child to exit (or ends it when asked, or when its output closed),
/// then answers what was in flight and reports why it stopped.
async fn keep(mut keeper: Keeper) {
    let lifetime = keeper.lifetime;
    let expired = async move {
        match lifetime {
            Some(lifetime) => tokio::time::sleep(lifetime).await,
            None => std::future::pending().await,
        }
    };
    let why = tokio::select! {
        status = keeper.child.wait() => {
            // What it wrote before it ended (its last answer, say) is routed before
            // the requests in flight hear it ended: its output ends with it, unless a
            // process it started still holds the pipe.
            let _ = tokio::time::timeout(EXIT_STATUS_WAIT, &mut keeper.output_done).await;
            describe_exit(status)
        }
        // A held stream keeps a session from idling: this bounds how long one
        // session can keep its place in the process limits.
        () = expired => {
            terminate(&mut keeper.child, keeper.pid).await;
            format!(
                "was ended at the session's maximum lifetime of {} ms \
                 (max_session_lifetime_ms)",
                lifetime.unwrap_or_default().as_millis()
            )
        }
        // Asked to stop, or the process handle was dropped: either way, end it.
        _ = &mut keeper.stop => {
            terminate(&mut keeper.child, keeper.pid).await;
            "was ended by the gateway".to_owned()
        }
        output = &mut keeper.output_done => {
            // A server that closed its output can never answer again: give it a
            // moment to exit by itself, then end it.
            let output = output.unwrap_or_else(|_| "closed its output".into());
            match tokio::time::timeout(EXIT_GRACE, keeper.child.wait()).await {
                Ok(status) => describe_exit(status),
                Err(_) => {
                    terminate(&mut keeper.child, keeper.pid).await;
                    output
                }
            }
        }
    };
    let told = keeper.conversation.lock().close(&why);
    // The place is free before anyone hears the child is gone.
    drop(keeper.slot);
    keeper.exited.send_replace(Some(why.clone()));
    // Ending the session finishes its streams: a request answered by a stream gets
    // its error event only if its pump took it first. Each request's reader drops its
    // end once it has its answer (or its client went away).
    let taken = futures_util::future::join_all(told.iter().map(|sink| sink.closed()));
    if tokio::time::timeout(EXIT_GRACE, taken).await.is_err() {
        debug!(
            pid = keeper.pid,
            "an answer of a request in flight was not taken in time"
        );
    }
    (keeper.on_exit)(why);
}

/// Ends a child that did not exit on its own: stdin is closed already; then SIGTERM,
/// then SIGKILL, each to its whole process group. The leader is not reaped before the
/// signals, so its group id cannot have been reused.
async fn terminate(child: &mut Child, pid: u32) {
    if tokio::time::timeout(EXIT_GRACE, child.wait()).await.is_ok() {
        return;
    }
    let group = Pid::from_raw(i32::try_from(pid).unwrap_or(0));
    if group.as_raw() > 0 {
        let _ = killpg(group, Signal::SIGTERM);
        if tokio::time::timeout(EXIT_GRACE, child.wait()).await.is_ok() {
            return;
        }
        let _ = killpg(group, Signal::SIGKILL);
    }
    let _ = child.kill().await;
}

fn describe_exit(status: std::io::Result<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(0), _) => "exited".to_owned(),
            (Some(127), _) => "exited with status 127 (command not found?)".to_owned(),
            (Some(code), _) => format!("exited with status {code}"),
            (None, Some(signal)) => match Signal::try_from(signal) {
                Ok(name) => format!("was killed by signal {signal} ({name})"),
                Err(_) => format!("was killed by signal {signal}"),
            },
            (None, None) => "exited".to_owned(),
        },
        Err(e) => format!("could not be waited for ({e})"),
    }
}

/// A request to fork a child on the spawner thread.
struct SpawnJob {
    command: Command,
    runtime: tokio::runtime::Handle,
    reply: oneshot::Sender<std::io::Result<Child>>,
}

/// Forks `command` on the spawner thread and returns the child.
async fn spawn(command: Command) -> Result<Child, String> {
    let (reply, child) = oneshot::channel();
    let job = SpawnJob {
        command,
        runtime: tokio::runtime::Handle::current(),
        reply,
    };
    spawn_thread()?
        .send(job)
        .map_err(|_| "the process spawner thread is gone".to_owned())?;
    child
        .await
        .map_err(|_| "the process spawner thread is gone".to_owned())?
        .map_err(|e| e.to_string())
}

/// The thread that forks every stdio child, started on first use. It lives as long
/// as the process, so `PR_SET_PDEATHSIG` in a child fires only when the worker dies.
fn spawn_thread() -> Result<&'static std::sync::mpsc::Sender<SpawnJob>, String> {
    static SPAWNER: OnceLock<Result<std::sync::mpsc::Sender<SpawnJob>, String>> = OnceLock::new();
    SPAWNER
        .get_or_init(|| {
            let (sender, jobs) = std::sync::mpsc::channel::<SpawnJob>();
            std::thread::Builder::new()
                .name("mcpgw-stdio-spawner".into())
                .spawn(move || {
                    for job in jobs {
                        // The child's pipes register with the runtime of the caller.
                        let _runtime = job.runtime.enter();
                        let mut command = job.command;
                        let _ = job.reply.send(command.spawn());
                    }
                })
                .map(|_| sender)
                .map_err(|e| format!("cannot start the process spawner thread: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// `mcpgw stdio-exec -- PROGRAM ARG…`: runs in the freshly forked child. Asks the
/// kernel for SIGKILL when the parent (the worker's spawner thread) goes, checks the
/// worker did not go before that, then becomes the program.
pub fn exec_child(command: Vec<String>) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let Some((program, args)) = command.split_first() else {
        eprintln!("mcpgw {EXEC_SUBCOMMAND}: no command given");
        return ExitCode::from(2);
    };
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        eprintln!("mcpgw {EXEC_SUBCOMMAND}: cannot tie the child's life to the worker's: {e}");
        return ExitCode::from(126);
    }
    let parent = std::env::var(ENV_PARENT_PID)
        .ok()
        .and_then(|pid| pid.parse::<i32>().ok());
    if parent != Some(nix::unistd::getppid().as_raw()) {
        // The worker died between the fork and the line above: nobody would reap us.
        eprintln!("mcpgw {EXEC_SUBCOMMAND}: the worker that started this child is gone");
        return ExitCode::from(1);
    }
    let error = std::process::Command::new(program)
        .args(args)
        .env_remove(ENV_PARENT_PID)
        .exec();
    eprintln!("mcpgw: cannot run the stdio upstream command {program:?}: {error}");
    ExitCode::from(127)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(program: &str, path: Option<&str>) -> StdioCommand {
        StdioCommand {
            program: program.to_owned(),
            args: Vec::new(),
            env: path
                .map(|p| [("PATH".to_owned(), p.to_owned())].into())
                .unwrap_or_default(),
            cwd: None,
            max_processes: 1,
            max_processes_per_principal: 1,
            max_session_lifetime: None,
        }
    }

    #[test]
    fn a_program_is_an_executable_path_or_a_name_on_the_childs_path() {
        assert_eq!(check_program(&command("/bin/sh", None)), Ok(()));
        assert_eq!(
            check_program(&command("sh", Some("/nonexistent:/bin"))),
            Ok(())
        );
        let not_found = check_program(&command("sh", Some("/nonexistent"))).unwrap_err();
        assert!(not_found.contains("sh is not found on PATH"), "{not_found}");
        let not_executable = check_program(&command("/etc/passwd", None)).unwrap_err();
        assert!(
            not_executable.contains("not an executable file"),
            "{not_executable}"
        );
    }
}
