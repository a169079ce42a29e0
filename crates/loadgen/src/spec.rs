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
    /// Sends here instead of the run's target (e.g. an internal listener);
    /// given several (gateway replicas), to each in turn.
    #[serde(default)]
    pub targets: Vec<String>,
    /// After a timeout, a 429 or a 503, sends the same request again at
    /// once (with a new id), up to this many times: a retry storm.
    #[serde(default)]
    pub retries: u32,
    /// Each request gets params of its own (a nonce), so the node can tell
    /// retries from new requests. Otherwise a method always has the same
    /// params.
    #[serde(default)]
    pub unique_params: bool,
    /// Reads of history instead (`run::history_params`): each request at a
    /// block of the first `run::HISTORY_BLOCKS`, most often a recent one,
    /// as explorers and indexers replay them.
    #[serde(default)]
    pub history: bool,
    /// The local address its connections come from (default: the kernel's
    /// choice). Any 127.x.y.z works on Linux without configuration, so
    /// clients on one machine can still be told apart by address.
    #[serde(default)]
    pub source: Option<std::net::IpAddr>,
    /// This client's own request timeout, instead of the run's.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Changes of rate during the run (`rate` holds until the first).
    #[serde(default)]
    pub phases: Vec<Phase>,
    /// The first request comes due this long after the start (clients
    /// alike in all else are spread over one period this way).
    #[serde(default)]
    pub offset_ms: u64,
}

/// From `at_ms` into the run on, the client sends `rate` requests per
/// second (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub at_ms: u64,
    pub rate: f64,
}

/// When a client's requests come due: `rate` from the start, then each
/// phase's rate from its time on. Request `j` of a step that starts at `t`
/// with rate `r` is due at `t + j / r`.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// `(from_s, rate)`, in time order, the first from 0.
    steps: Vec<(f64, f64)>,
    offset_s: f64,
}

impl Schedule {
    pub fn of(client: &ClientSpec) -> Self {
        Self::new(client.rate, &client.phases, client.offset_ms)
    }

    pub fn new(rate: f64, phases: &[Phase], offset_ms: u64) -> Self {
        let mut steps = vec![(0.0, rate)];
        let mut phases = phases.to_vec();
        phases.sort_by_key(|p| p.at_ms);
        steps.extend(phases.iter().map(|p| (p.at_ms as f64 / 1000.0, p.rate)));
        Self {
            steps,
            offset_s: offset_ms as f64 / 1000.0,
        }
    }

    /// The times (seconds from the start) at which requests come due
    /// within `duration_s`, in order.
    pub fn dues(&self, duration_s: f64) -> impl Iterator<Item = f64> + '_ {
        self.steps
            .iter()
            .enumerate()
            .flat_map(move |(k, &(from, rate))| {
                let from = if k == 0 { self.offset_s } else { from };
                let until = self
                    .steps
                    .get(k + 1)
                    .map_or(duration_s, |s| s.0)
                    .min(duration_s);
                let count = if rate > 0.0 && until > from {
                    ((until - from) * rate).ceil() as u64
                } else {
                    0
                };
                (0..count).map(move |j| from + j as f64 / rate)
            })
    }

    /// Requests per second on average over `duration_s`.
    pub fn mean_rate(&self, duration_s: f64) -> f64 {
        if duration_s <= 0.0 {
            return 0.0;
        }
        self.dues(duration_s).count() as f64 / duration_s
    }

    pub fn is_steady(&self) -> bool {
        self.steps.len() == 1
    }
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
            targets: Vec::new(),
            retries: 0,
            unique_params: false,
            history: false,
            source: None,
            timeout_ms: None,
            phases: Vec::new(),
            offset_ms: 0,
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.id.is_empty() {
            bail!("client id is empty");
        }
        let rates = std::iter::once(self.rate).chain(self.phases.iter().map(|p| p.rate));
        if rates.clone().any(|r| !(r.is_finite() && r >= 0.0))
            || !rates.clone().any(|r| r > 0.0)
            || (self.phases.is_empty() && self.rate <= 0.0)
        {
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
                "target" => spec.targets.push(value.into()),
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
                "history" => {
                    spec.history = value
                        .parse()
                        .with_context(|| format!("client {text:?}: history {value:?} (true or false)"))?
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
    fn a_schedule_follows_its_phases() {
        let client = ClientSpec {
            phases: vec![
                Phase {
                    at_ms: 2000,
                    rate: 0.0,
                },
                Phase {
                    at_ms: 1000,
                    rate: 4.0,
                },
            ],
            ..ClientSpec::new("a", 2.0)
        };
        let schedule = Schedule::of(&client);
        let dues: Vec<f64> = schedule.dues(3.0).collect();
        assert_eq!(dues, vec![0.0, 0.5, 1.0, 1.25, 1.5, 1.75]);
        assert_eq!(schedule.mean_rate(3.0), 2.0);
        assert!(!schedule.is_steady());
        assert_eq!(
            Schedule::of(&ClientSpec::new("b", 10.0)).dues(1.0).count(),
            10
        );
        let late = Schedule::new(2.0, &[], 250);
        assert_eq!(
            late.dues(2.0).collect::<Vec<f64>>(),
            vec![0.25, 0.75, 1.25, 1.75]
        );
    }

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
