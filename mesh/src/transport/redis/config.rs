//! Where the Redis transport finds Redis and how it names its channels: the one
//! setting both ends of the baseline transport share.

use std::fmt;

use crate::redis_conn::redact_url;

/// Where the Redis transport finds Redis, and how it names its channels.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTransportConfig {
    /// `redis://[user:password@]host:port[/db]`, normally the fleet directory's Redis.
    /// The password never appears in errors or logs.
    pub redis_url: String,
    /// Prepended to every channel name (as to the directory's keys), so that several
    /// fleets can share one Redis.
    pub prefix: String,
}

impl Default for RedisTransportConfig {
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".into(),
            prefix: "mcpgw:".into(),
        }
    }
}

impl fmt::Debug for RedisTransportConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransportConfig")
            .field("redis_url", &redact_url(&self.redis_url))
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisTransportConfig {
    /// The channel worker `worker_id` takes requests on: `{prefix}pool_rpc:{worker_id}`.
    pub fn request_channel(&self, worker_id: &str) -> String {
        format!("{}pool_rpc:{worker_id}", self.prefix)
    }

    /// The channel worker `worker_id` takes replies on: `{prefix}pool_reply:{worker_id}`.
    pub fn reply_channel(&self, worker_id: &str) -> String {
        format!("{}pool_reply:{worker_id}", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_follow_the_prefix() {
        let config = RedisTransportConfig {
            prefix: "t:".into(),
            ..RedisTransportConfig::default()
        };
        assert_eq!(config.request_channel("w1"), "t:pool_rpc:w1");
        assert_eq!(config.reply_channel("w1"), "t:pool_reply:w1");
        let secret = RedisTransportConfig {
            redis_url: "redis://u:s3cret@h:1".into(),
            ..RedisTransportConfig::default()
        };
        assert!(!format!("{secret:?}").contains("s3cret"));
    }
}
