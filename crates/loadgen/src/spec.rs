//! What to send: client identities and the run's bounds.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

/// No run is longer than this, whatever the caller asks.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);

/// One client identity: its own schedule, key, method mix and in-flight cap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientSpec {
    pub id: String,
    /// Requests per second, on a fixed schedule.
    pub rate: f64,
    /// Sent in `key_header` when set.
    #[serde(default)]
    pub api_key: Option<String>,
    #[serde(default = "default_key_header")]
    pub key_header: String,
    /// Method name and relative weight.
    #[serde(default = "default_mix")]
    pub mix: BTreeMap<String, f64>,
    /// At most this many requests in flight; a request that comes due at
    /// the cap is not sent and is counted as `skipped_at_cap`.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Sends here instead of the run's target (e.g. an internal listener).
    #[serde(default)]
    pub target: Option<String>,
    /// After a timeout, a 429 or a 503, sends the same request again at
    /// once (with a new id), up to this many times: a retry storm.
    #[serde(default)]
    pub retries: u32,
    /// Each request gets params of its own (a nonce), so the node can tell
    /// retries from new requests. Otherwise a method always has the same
    /// params.
    #[serde(default)]
    pub unique_params: bool,
    /// The local address its connections come from (default: the kernel's
    /// choice). Any 127.x.y.z works on Linux without configuration, so
    /// clients on one machine can still be told apart by address.
    #[serde(default)]
    pub source: Option<std::net::IpAddr>,
    /// This client's own request timeout, instead of the run's.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

fn default_key_header() -> String {
    "x-api-key".into()
}

fn default_mix() -> BTreeMap<String, f64> {
    BTreeMap::from([("eth_blockNumber".into(), 1.0)])
}

fn default_concurrency() -> usize {
    1024
}

impl ClientSpec {
    pub fn new(id: &str, rate: f64) -> Self {
        Self {
            id: id.into(),
            rate,
            api_key: None,
            key_header: default_key_header(),
            mix: default_mix(),
            concurrency: default_concurrency(),
            target: None,
            retries: 0,
            unique_params: false,
            source: None,
            timeout_ms: None,
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.id.is_empty() {
            bail!("client id is empty");
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            bail!(
                "client {}: rate must be a positive number, got {}",
                self.id,
                self.rate
            );
        }
        if self.concurrency == 0 {
            bail!("client {}: concurrency must be at least 1", self.id);
        }
        if self.mix.is_empty() || self.mix.iter().any(|(_, w)| !(w.is_finite() && *w > 0.0)) {
            bail!(
                "client {}: mix needs at least one method, each with a positive weight",
                self.id
            );
        }
        Ok(())
    }
}

/// Parses the command-line form:
/// `id=alice,rate=500,key=secret,header=x-api-key,mix=eth_call:8+eth_blockNumber:2,concurrency=256,retries=3,unique=true,source=127.0.0.2`.
impl FromStr for ClientSpec {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> anyhow::Result<Self> {
        let mut spec = ClientSpec::new("", 0.0);
        for field in text.split(',') {
            let Some((name, value)) = field.split_once('=') else {
                bail!("client {text:?}: expected NAME=VALUE, got {field:?}");
            };
            match name {
                "id" => spec.id = value.into(),
                "rate" => {
                    spec.rate = value
                        .parse()
                        .with_context(|| format!("client {text:?}: rate {value:?}"))?
                }
                "key" => spec.api_key = Some(value.into()),
                "header" => spec.key_header = value.into(),
                "concurrency" => {
                    spec.concurrency = value
                        .parse()
                        .with_context(|| format!("client {text:?}: concurrency {value:?}"))?
                }
                "mix" => spec.mix = parse_mix(value).with_context(|| format!("client {text:?}"))?,
                "target" => spec.target = Some(value.into()),
                "retries" => {
                    spec.retries = value
                        .parse()
                        .with_context(|| format!("client {text:?}: retries {value:?}"))?
                }
                "unique" => {
                    spec.unique_params = value
                        .parse()
                        .with_context(|| format!("client {text:?}: unique {value:?} (true or false)"))?
                }
                "source" => {
                    spec.source = Some(
                        value
                            .parse()
                            .with_context(|| format!("client {text:?}: source {value:?}"))?,
                    )
                }
                other => bail!(
                    "client {text:?}: unknown field {other:?} (known: id, rate, key, header, mix, concurrency, target, retries, unique, source)"
                ),
            }
        }
        spec.validate()?;
        Ok(spec)
    }
}

fn parse_mix(text: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    text.split('+')
        .map(|entry| match entry.split_once(':') {
            None => Ok((entry.to_string(), 1.0)),
            Some((method, weight)) => Ok((
                method.to_string(),
                weight
                    .parse()
                    .with_context(|| format!("mix weight {weight:?} for {method}"))?,
            )),
        })
        .collect()
}

/// The run: where to send, how long, and who sends.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// `http://host:port/path`.
    pub target: String,
    pub duration: Duration,
    /// Per client, at most this many requests come due.
    pub max_requests: u64,
    /// A request not answered in this time counts as a timeout.
    pub timeout: Duration,
    /// Speak HTTP/2 with prior knowledge (h2c) instead of HTTP/1.1.
    pub http2: bool,
    /// HTTP/2 connections per client, used in turn (HTTP/1.1 opens as many
    /// as its in-flight requests need).
    pub connections: usize,
    pub clients: Vec<ClientSpec>,
}

impl RunSpec {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.duration.is_zero() || self.duration > MAX_DURATION {
            bail!(
                "duration must be between 0 and {MAX_DURATION:?}, got {:?}",
                self.duration
            );
        }
        if self.max_requests == 0 {
            bail!("max requests must be at least 1");
        }
        if self.connections == 0 {
            bail!("connections must be at least 1");
        }
        if self.timeout.is_zero() {
            bail!("timeout must be positive");
        }
        if self.clients.is_empty() {
            bail!("at least one client is needed");
        }
        for client in &self.clients {
            client.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_form_parses() {
        let spec: ClientSpec =
            "id=alice,rate=500,key=s3cret,mix=eth_call:8+eth_blockNumber:2,concurrency=64"
                .parse()
                .unwrap();
        assert_eq!(spec.id, "alice");
        assert_eq!(spec.rate, 500.0);
        assert_eq!(spec.api_key.as_deref(), Some("s3cret"));
        assert_eq!(spec.key_header, "x-api-key");
        assert_eq!(
            spec.mix,
            BTreeMap::from([("eth_call".into(), 8.0), ("eth_blockNumber".into(), 2.0)])
        );
        assert_eq!(spec.concurrency, 64);
    }

    #[test]
    fn bad_forms_say_what_is_wrong() {
        let err = "id=a,rate=0".parse::<ClientSpec>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "client a: rate must be a positive number, got 0"
        );
        let err = "id=a,rate=1,colour=red".parse::<ClientSpec>().unwrap_err();
        assert!(
            err.to_string().contains("unknown field \"colour\""),
            "{err}"
        );
        let err = "id=a,rate=1,mix=eth_call:-1"
            .parse::<ClientSpec>()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "client a: mix needs at least one method, each with a positive weight"
        );
    }
}
