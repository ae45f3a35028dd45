//! Just enough of a Redis client for measurements: `INFO` (command counts, memory,
//! the server's pid), `PING` and `MEMORY USAGE`. A few dozen lines of RESP keep the
//! bench free of a client library whose own traffic we would then have to subtract.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Deadline of one command: the bench only ever sends cheap ones.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// A RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

/// One connection to Redis.
pub struct RedisClient {
    stream: TcpStream,
    /// Bytes read but not yet parsed.
    buffer: Vec<u8>,
}

/// Where a `redis://[user:password@]host[:port][/db]` URL points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisAddr {
    pub host_port: String,
    pub password: Option<String>,
    pub user: Option<String>,
}

pub fn parse_redis_url(url: &str) -> Result<RedisAddr, String> {
    let rest = url.strip_prefix("redis://").ok_or_else(|| {
        format!("{url:?}: only redis:// URLs are supported by the bench's measurements")
    })?;
    let authority = rest.split('/').next().unwrap_or_default();
    let (credentials, host) = match authority.rsplit_once('@') {
        Some((credentials, host)) => (Some(credentials), host),
        None => (None, authority),
    };
    let (user, password) = match credentials.map(|c| c.split_once(':')) {
        Some(Some((user, password))) => (
            (!user.is_empty()).then(|| user.to_owned()),
            Some(password.to_owned()),
        ),
        Some(None) => (None, credentials.map(str::to_owned)),
        None => (None, None),
    };
    if host.is_empty() {
        return Err(format!("{url:?} has no host"));
    }
    let host_port = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:6379")
    };
    Ok(RedisAddr {
        host_port,
        password,
        user,
    })
}

impl RedisClient {
    pub async fn connect(url: &str) -> Result<RedisClient, String> {
        let addr = parse_redis_url(url)?;
        let stream = tokio::time::timeout(COMMAND_TIMEOUT, TcpStream::connect(&addr.host_port))
            .await
            .map_err(|_| format!("connecting to Redis at {} timed out", addr.host_port))?
            .map_err(|e| format!("cannot connect to Redis at {}: {e}", addr.host_port))?;
        let mut client = RedisClient {
            stream,
            buffer: Vec::new(),
        };
        if let Some(password) = &addr.password {
            let mut auth = vec!["AUTH"];
            if let Some(user) = &addr.user {
                auth.push(user);
            }
            auth.push(password);
            client.command(&auth).await?;
        }
        Ok(client)
    }

    /// Sends one command and returns its reply; a Redis error reply is an `Err`.
    pub async fn command(&mut self, args: &[&str]) -> Result<Resp, String> {
        let request = encode_command(args);
        let exchange = async {
            self.stream
                .write_all(&request)
                .await
                .map_err(|e| format!("Redis write failed: {e}"))?;
            loop {
                if let Some((reply, used)) = parse_resp(&self.buffer)? {
                    self.buffer.drain(..used);
                    return Ok(reply);
                }
                let mut chunk = [0u8; 16 * 1024];
                let n = self
                    .stream
                    .read(&mut chunk)
                    .await
                    .map_err(|e| format!("Redis read failed: {e}"))?;
                if n == 0 {
                    return Err("Redis closed the connection".to_owned());
                }
                self.buffer.extend_from_slice(&chunk[..n]);
            }
        };
        let reply = tokio::time::timeout(COMMAND_TIMEOUT, exchange)
            .await
            .map_err(|_| format!("Redis {} timed out", args.first().unwrap_or(&"")))??;
        match reply {
            Resp::Error(message) => Err(format!("Redis refused {args:?}: {message}")),
            reply => Ok(reply),
        }
    }

    /// `INFO section` as text.
    pub async fn info(&mut self, section: &str) -> Result<String, String> {
        match self.command(&["INFO", section]).await? {
            Resp::Bulk(Some(bytes)) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
            other => Err(format!("unexpected INFO reply {other:?}")),
        }
    }

    /// Calls per command since the server started (`INFO commandstats`).
    pub async fn command_counts(&mut self) -> Result<BTreeMap<String, u64>, String> {
        Ok(parse_commandstats(&self.info("commandstats").await?))
    }

    /// One numeric field of `INFO section`.
    pub async fn info_number(&mut self, section: &str, field: &str) -> Result<u64, String> {
        let info = self.info(section).await?;
        info_field(&info, field).ok_or_else(|| format!("INFO {section} has no {field}"))
    }
}

fn encode_command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Parses one reply from the front of `input`: `Ok(None)` when more bytes are needed,
/// otherwise the reply and how many bytes it used.
pub fn parse_resp(input: &[u8]) -> Result<Option<(Resp, usize)>, String> {
    let Some(line_end) = input.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let Some((&kind, line)) = input[..line_end].split_first() else {
        return Err("empty RESP line".into());
    };
    let line = String::from_utf8_lossy(line).into_owned();
    let after = line_end + 2;
    let number = || {
        line.parse::<i64>()
            .map_err(|_| format!("bad RESP length {line:?}"))
    };
    match kind {
        b'+' => Ok(Some((Resp::Simple(line), after))),
        b'-' => Ok(Some((Resp::Error(line), after))),
        b':' => Ok(Some((Resp::Integer(number()?), after))),
        b'$' => {
            let Ok(len) = usize::try_from(number()?) else {
                return Ok(Some((Resp::Bulk(None), after)));
            };
            if input.len() < after + len + 2 {
                return Ok(None);
            }
            let data = input[after..after + len].to_vec();
            Ok(Some((Resp::Bulk(Some(data)), after + len + 2)))
        }
        b'*' => {
            let Ok(count) = usize::try_from(number()?) else {
                return Ok(Some((Resp::Array(None), after)));
            };
            let mut items = Vec::with_capacity(count.min(1024));
            let mut used = after;
            for _ in 0..count {
                match parse_resp(&input[used..])? {
                    Some((item, n)) => {
                        items.push(item);
                        used += n;
                    }
                    None => return Ok(None),
                }
            }
            Ok(Some((Resp::Array(Some(items)), used)))
        }
        other => Err(format!("unknown RESP type byte {other:#x}")),
    }
}

/// `cmdstat_<name>:calls=N,...` lines of `INFO commandstats` as name → calls.
pub fn parse_commandstats(info: &str) -> BTreeMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Commands executed between two `INFO commandstats` snapshots, leaving out `info`
/// itself (the bench's own measuring) and commands with no calls in between.
pub fn command_delta(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .filter_map(|(name, calls)| {
            let delta = calls.saturating_sub(before.get(name).copied().unwrap_or(0));
            (delta > 0).then(|| (name.clone(), delta))
        })
        .collect()
}

/// A numeric `field:value` of INFO text.
pub fn info_field(info: &str, field: &str) -> Option<u64> {
    info.lines().find_map(|line| {
        let (name, value) = line.trim().split_once(':')?;
        (name == field).then(|| value.trim().parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse_whole_or_ask_for_more() {
        assert_eq!(
            parse_resp(b"+PONG\r\n"),
            Ok(Some((Resp::Simple("PONG".into()), 7)))
        );
        assert_eq!(parse_resp(b":42\r\n"), Ok(Some((Resp::Integer(42), 5))));
        assert_eq!(parse_resp(b"$5\r\nhel"), Ok(None));
        assert_eq!(
            parse_resp(b"$5\r\nhello\r\n"),
            Ok(Some((Resp::Bulk(Some(b"hello".to_vec())), 11)))
        );
        assert_eq!(parse_resp(b"$-1\r\n"), Ok(Some((Resp::Bulk(None), 5))));
        assert_eq!(
            parse_resp(b"*2\r\n:1\r\n$1\r\nx\r\n"),
            Ok(Some((
                Resp::Array(Some(vec![
                    Resp::Integer(1),
                    Resp::Bulk(Some(b"x".to_vec()))
                ])),
                15
            )))
        );
        assert_eq!(parse_resp(b"*2\r\n:1\r\n"), Ok(None));
        assert!(parse_resp(b"?what\r\n").is_err());
    }

    #[test]
    fn commandstats_deltas_leave_out_info() {
        let before = parse_commandstats(
            "# Commandstats\r\ncmdstat_get:calls=10,usec=5,usec_per_call=0.5,rejected_calls=0,failed_calls=0\r\n\
             cmdstat_info:calls=3,usec=1\r\n",
        );
        let after = parse_commandstats(
            "cmdstat_get:calls=12,usec=7\r\ncmdstat_publish:calls=4,usec=9\r\n\
             cmdstat_info:calls=5,usec=2\r\ncmdstat_client|setname:calls=1,usec=1\r\n",
        );
        let delta = command_delta(&before, &after);
        assert_eq!(delta.get("get"), Some(&2));
        assert_eq!(delta.get("publish"), Some(&4));
        assert_eq!(delta.get("client|setname"), Some(&1));
        assert!(!delta.contains_key("info"));
    }

    #[test]
    fn info_fields_and_urls() {
        assert_eq!(
            info_field(
                "# Memory\r\nused_memory:1024\r\nused_memory_human:1K\r\n",
                "used_memory"
            ),
            Some(1024)
        );
        assert_eq!(
            parse_redis_url("redis://127.0.0.1:7000/0").map(|a| a.host_port),
            Ok("127.0.0.1:7000".into())
        );
        let with_auth = parse_redis_url("redis://bench:secret@db/1").unwrap();
        assert_eq!(with_auth.host_port, "db:6379");
        assert_eq!(with_auth.user.as_deref(), Some("bench"));
        assert_eq!(with_auth.password.as_deref(), Some("secret"));
        assert!(parse_redis_url("rediss://x").is_err());
    }
}
