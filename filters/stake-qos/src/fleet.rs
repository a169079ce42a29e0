//! Fleet mode's host calls (`stakegate_core::qos::fleet` has the rule and
//! `fleet::exchange` the exchange's states): the callout to Webdis, sent
//! from the root context of the VM that ran the round, and its answer.

use crate::log;
use proxy_wasm::types::LogLevel;
use stakegate_core::qos::counts::Counts;
use stakegate_core::qos::fleet::exchange::{Exchange, Heard};
use stakegate_core::qos::fleet::{self, FleetPolicy, RoundFleet};
use stakegate_core::qos::StakeQos;
use stakegate_glue::host::{self, BodyOf};
use stakegate_glue::{now_ms, now_us, property_string, EnvoyStore};
use std::hash::BuildHasher;

/// One VM's link to the fleet.
pub struct FleetLink {
    exchange: Exchange,
    cluster: String,
    timeout_ms: u64,
    /// Webdis's credentials as a header, from Envoy's environment.
    authorization: Option<String>,
}

impl FleetLink {
    /// The link for `policy`; the replica's name is the policy's, or
    /// Envoy's node id, and its instance this Envoy's, drawn by its first
    /// VM.
    pub fn new(policy: &FleetPolicy) -> Result<Self, String> {
        let node_id =
            property_string(&["xds", "node", "id"]).or_else(|| property_string(&["node", "id"]));
        // std's hasher keys come from the host's randomness (WASI random_get).
        let drawn = std::collections::hash_map::RandomState::new().hash_one(now_us());
        let instance = fleet::instance(&EnvoyStore, drawn)
            .map_err(|e| format!("fleet mode: this Envoy's instance number in shared data: {e}"))?;
        let authorization = std::env::var(fleet::AUTH_ENV)
            .ok()
            .filter(|c| !c.is_empty())
            .map(|c| fleet::basic_authorization(&c));
        Ok(Self {
            exchange: Exchange::new(policy, node_id, instance)?,
            cluster: policy.cluster.clone(),
            timeout_ms: policy.timeout_ms,
            authorization,
        })
    }

    /// At a tick: an exchange that has not answered in time has failed, and
    /// the round this VM just ran, if any, sends the next one when due.
    pub fn tick(&mut self, qos: &StakeQos, round: Option<RoundFleet>, counts: &mut Counts) {
        let now = now_ms();
        if let Some(heard) = self.exchange.expire(now) {
            record(heard, counts);
        }
        let Some(mut round) = round else { return };
        counts.fleet_round = Some((round.replicas, round.fallback));
        let Some(body) = self.exchange.request(qos, &mut round) else {
            return;
        };
        let mut headers = vec![
            (":method", "POST".to_string()),
            (":path", "/".into()),
            (":authority", "webdis".into()),
            ("content-type", "text/plain".into()),
        ];
        if let Some(authorization) = &self.authorization {
            headers.push(("authorization", authorization.clone()));
        }
        let sent = host::dispatch_call(&self.cluster, &headers, &body, self.timeout_ms);
        match sent {
            Ok(token) => self.exchange.sent(token, now),
            Err(status) => {
                let why = format!(
                    "the callout to cluster {:?} was refused ({status:?}): check fleet.cluster",
                    self.cluster
                );
                record(self.exchange.refused(why), counts);
            }
        }
    }

    /// Whether `token` is this link's exchange.
    pub fn owns(&self, token: u32) -> bool {
        self.exchange.owns(token)
    }

    /// The answer to the exchange in flight.
    pub fn answered(
        &mut self,
        qos: &StakeQos,
        num_headers: usize,
        body_size: usize,
        counts: &mut Counts,
    ) {
        let status = (num_headers > 0)
            .then(|| host::call_response_header(":status").and_then(|s| s.parse().ok()))
            .flatten();
        let body = host::body(BodyOf::CallResponse, 0, body_size);
        if let Some(heard) = self
            .exchange
            .answered(qos, &EnvoyStore, now_ms(), status, &body)
        {
            record(heard, counts);
        }
    }
}

fn record(heard: Heard, counts: &mut Counts) {
    match heard {
        Heard::Exchanged {
            took_ms,
            back,
            duplicate_names,
            warn,
        } => {
            counts.fleet_exchanged(took_ms, duplicate_names);
            if let Some(line) = back {
                log(LogLevel::Info, &line);
            }
            if let Some(line) = warn {
                log(LogLevel::Warn, &line);
            }
        }
        Heard::Failed { log: line } => {
            counts.fleet_failures += 1;
            if let Some(line) = line {
                log(LogLevel::Warn, &line);
            }
        }
    }
}
