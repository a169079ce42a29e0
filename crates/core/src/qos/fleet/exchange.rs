//! One VM's side of the exchange with the fleet's engine: at most one
//! exchange in flight, a timeout of its own, and each spell of failures
//! logged once.
//!
//! The filter sends the callout and hands over what comes back; this says
//! what it means. Envoy holds a callout to a cluster with no healthy host
//! without end (its own timeout does not fire then), so an exchange not
//! answered within `fleet.timeoutMs` is failed here, at a tick.
//!
//! **Which answers are trusted.** An answer lists the replicas that have
//! reported within `memberTtlMs`. After Redis restarts it is empty, and the
//! first answers list only the replicas that have reported since: one that
//! trusted them would count too few replicas and give out too much. So an
//! answer that lists fewer replicas than the last one is taken for its
//! fleet size only, unless it is the second in a row (every live replica
//! reports once per `syncMs`, so by then each has).

use super::policy::is_name;
use super::{member_name, FleetPolicy, FleetView, RoundFleet, FLEET_KEY};
use crate::qos::StakeQos;
use crate::shared::SharedStore;
use crate::shared::{update, Change};

/// What the filter should record (and log) after an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    /// An answer was taken, `took_ms` after the exchange was sent.
    /// `back`: the first after a failure, to log. `duplicate_names`:
    /// replica names two Envoys have been reporting under for longer than
    /// `memberTtlMs`; `warn`: the first answer that says so, to log.
    Exchanged {
        took_ms: u64,
        back: Option<String>,
        duplicate_names: u32,
        warn: Option<String>,
    },
    /// The exchange failed. `log`: the first failure of a spell, to log.
    Failed { log: Option<String> },
}

/// One VM's link to the fleet.
#[derive(Debug)]
pub struct Exchange {
    /// This replica's member name: `replica~instance`.
    member: String,
    member_ttl_ms: u64,
    timeout_ms: u64,
    /// The exchange in flight: its callout token and when it was sent.
    pending: Option<(u32, u64)>,
    /// Why the current spell of failures began.
    failing: Option<String>,
    /// Answers taken in a row.
    answered_in_a_row: u32,
    /// Replicas the last answer listed.
    replicas_seen: usize,
    /// Since when answers have listed a replica name twice, and whether
    /// that was logged.
    duplicates_since: Option<u64>,
    told_duplicates: bool,
}

impl Exchange {
    /// The link for `policy`: this replica is named by the policy, or by
    /// Envoy's node id; `instance` is this Envoy's (`fleet::instance`).
    pub fn new(
        policy: &FleetPolicy,
        node_id: Option<String>,
        instance: u64,
    ) -> Result<Self, String> {
        let replica = match &policy.replica {
            Some(name) => name.clone(),
            None => node_id.unwrap_or_default(),
        };
        if !is_name(&replica) {
            return Err(format!(
                "policy rejected: fleet.replica: not set, and Envoy's node id ({replica:?}) is not 1-64 characters of A-Z, a-z, 0-9, _ or -: set fleet.replica, or start Envoy with --service-node"
            ));
        }
        Ok(Self {
            member: member_name(&replica, instance),
            member_ttl_ms: policy.member_ttl_ms,
            timeout_ms: policy.timeout_ms,
            pending: None,
            failing: None,
            answered_in_a_row: 0,
            replicas_seen: 0,
            duplicates_since: None,
            told_duplicates: false,
        })
    }

    /// This replica's member name in the fleet.
    pub fn member(&self) -> &str {
        &self.member
    }

    /// At a tick: an exchange unanswered past `timeoutMs` has failed.
    pub fn expire(&mut self, now_ms: u64) -> Option<Heard> {
        let (_, asked) = self.pending?;
        if now_ms.saturating_sub(asked) <= self.timeout_ms {
            return None;
        }
        self.pending = None;
        Some(self.failed(format!(
            "no answer within fleet.timeoutMs ({} ms)",
            self.timeout_ms
        )))
    }

    /// The engine request for the round this VM just ran, when one is due
    /// and none is in flight.
    pub fn request(&self, qos: &StakeQos, round: &mut RoundFleet) -> Option<Vec<u8>> {
        if self.pending.is_some() {
            return None;
        }
        qos.fleet_exchange(round, &self.member)
    }

    /// The callout for `request` went out as `token`.
    pub fn sent(&mut self, token: u32, now_ms: u64) {
        self.pending = Some((token, now_ms));
    }

    /// The callout could not be made.
    pub fn refused(&mut self, why: String) -> Heard {
        self.failed(why)
    }

    /// Whether `token` is this link's exchange.
    pub fn owns(&self, token: u32) -> bool {
        self.pending.is_some_and(|(t, _)| t == token)
    }

    /// The answer to the exchange in flight: its status (`None`: the
    /// callout failed: reset, timeout, no host) and body.
    pub fn answered(
        &mut self,
        qos: &StakeQos,
        store: &impl SharedStore,
        now_ms: u64,
        status: Option<u32>,
        body: &[u8],
    ) -> Option<Heard> {
        let (_, asked) = self.pending.take()?;
        let taken = match status {
            None => Err("the callout failed (reset, timeout or no host)".to_string()),
            Some(200) => {
                let trust = self.answered_in_a_row > 0;
                qos.fleet_answer(store, &self.member, asked, now_ms, body, |listed| {
                    trust || listed >= self.replicas_seen
                })
            }
            Some(status @ (401 | 403)) => Err(format!(
                "the engine refused the exchange ({status}): give Envoy the credentials Webdis's ACL has for EVALSHA in {}=user:password",
                super::AUTH_ENV
            )),
            Some(other) => Err(format!(
                "the engine answered {other}: {:?}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            )),
        };
        Some(match taken {
            Ok((view, duplicates)) => {
                self.answered_in_a_row += 1;
                self.replicas_seen = view.replicas as usize;
                let back = self.failing.take().map(|_| {
                    format!(
                        "fleet exchange works again: {} replicas, this one's capacity {:.0} rps",
                        view.replicas, view.capacity_rps
                    )
                });
                let (duplicate_names, warn) = self.duplicates(&duplicates, now_ms);
                Heard::Exchanged {
                    took_ms: now_ms.saturating_sub(asked),
                    back,
                    duplicate_names,
                    warn,
                }
            }
            Err(why) => self.failed(why),
        })
    }

    /// Names two Envoys report under: counted (and logged once) only once
    /// they have for longer than `memberTtlMs`, by when a restarted Envoy's
    /// old self has left the fleet.
    fn duplicates(&mut self, names: &[String], now_ms: u64) -> (u32, Option<String>) {
        if names.is_empty() {
            self.duplicates_since = None;
            self.told_duplicates = false;
            return (0, None);
        }
        let since = *self.duplicates_since.get_or_insert(now_ms);
        if now_ms.saturating_sub(since) <= self.member_ttl_ms {
            return (0, None);
        }
        let warn = (!std::mem::replace(&mut self.told_duplicates, true)).then(|| {
            format!(
                "two or more gateways report to the fleet as {names:?}: each is counted as a replica of its own, but give each its own name (fleet.replica, or envoy --service-node)"
            )
        });
        (names.len() as u32, warn)
    }

    fn failed(&mut self, why: String) -> Heard {
        self.answered_in_a_row = 0;
        let log = self.failing.is_none().then(|| {
            format!(
                "fleet exchange failed: {why}; serving the last allocation, then capacity ÷ the replicas last seen once it is older than fleet.staleMs (logged once until it works again)"
            )
        });
        self.failing = Some(why);
        Heard::Failed { log }
    }
}

/// Fleet mode's side of a VM's QoS: the report to send, and the answer
/// taken.
impl StakeQos {
    /// Fleet mode: the Webdis request body for the exchange that round
    /// `fleet` (this VM's, just run) sends as `replica`, if one is due.
    pub fn fleet_exchange(&self, fleet: &mut RoundFleet, replica: &str) -> Option<Vec<u8>> {
        let policy = self.policy.fleet.as_ref()?;
        if !policy.due(self.state.round, self.policy.refill_interval_ms) {
            return None;
        }
        fleet.report.keep_busiest(policy.max_identities as usize);
        Some(policy.request(replica, &fleet.report))
    }

    /// Fleet mode: takes the engine's answer to an exchange sent at
    /// `asked_ms` as `member`, and keeps the allocation it gives for the
    /// next rounds (unless an answer to a later exchange is already kept).
    /// An answer `trust` refuses, given how many replicas it lists, gives
    /// only the fleet's size (`fleet::exchange` says when). Returns the
    /// view kept and the replica names more than one member reports under.
    pub fn fleet_answer(
        &self,
        store: &impl SharedStore,
        member: &str,
        asked_ms: u64,
        now_ms: u64,
        body: &[u8],
        trust: impl FnOnce(usize) -> bool,
    ) -> Result<(FleetView, Vec<String>), String> {
        let Some(policy) = &self.policy.fleet else {
            return Err("fleet mode is off".into());
        };
        let reports = super::parse_answer(body)?;
        if reports.len() > policy.max_replicas as usize {
            return Err(format!(
                "the engine lists {} replicas, more than fleet.maxReplicas ({}): reports no gateway sent? (keep Webdis reachable by the gateways only)",
                reports.len(),
                policy.max_replicas
            ));
        }
        if !reports.iter().any(|(name, _)| name == member) {
            return Err(format!(
                "the answer has no report of this replica ({member:?}): something else writes to the fleet's keys"
            ));
        }
        let trusted = trust(reports.len());
        let view = super::allocate(self.policy.capacity_rps, &reports, member, asked_ms, now_ms);
        let kept = update(store, FLEET_KEY, |kept: &mut FleetView| {
            if kept.asked_ms > asked_ms {
                Change::Keep(kept.clone())
            } else if trusted {
                *kept = view.clone();
                Change::Write(view.clone())
            } else {
                kept.replicas = view.replicas;
                Change::Write(kept.clone())
            }
        })
        .map_err(|(e, _)| format!("shared data: {e}"))?;
        Ok((kept.value, super::duplicate_names(&reports)))
    }
}
