//! Fleet mode: several gateway replicas share one capacity and one stake
//! table, through Redis.
//!
//! # The exchange
//!
//! Every `fleet.syncMs` the VM that ran a replica's refill round sends one
//! HTTP callout from its root context to Webdis (Redis over HTTP), which
//! runs one Lua script (`SCRIPT`) in Redis: it stores this replica's
//! *report* (the demand of each of its active identities, `Report`) under
//! its name with a time to live of `fleet.memberTtlMs`, marks the replica
//! live, drops replicas not heard from within that time, and answers every
//! live replica's report. The request path never waits for it: requests
//! are admitted from the local buckets as on one gateway.
//!
//! # The allocation (`allocate`)
//!
//! From the reports every replica computes the same thing: an identity's
//! fleet-wide demand `D = Σ_r d_r` (its calls per second at each replica),
//! and its fleet-wide share `a = min(D, λ × stake)` by the weighted max-min
//! rule over `capacityRps` (`fair`), exactly as one gateway would with all
//! the traffic. A replica gives out the part of `a` that matches where the
//! identity's demand arrives, `a × d_r / D`: its local round runs with
//! capacity `C_r = Σ a × d_r / D` (plus a part of any unused capacity) and
//! each identity's stake weighted by `d_r / D`. With those inputs the local
//! round's water level is the fleet's, so each identity gets its fleet
//! share split across the replicas it uses, and the replicas' capacities
//! add up to `capacityRps`.
//!
//! Unused capacity (fleet demand below capacity) is split in proportion to
//! each replica's demand, a tenth of it evenly, so that a replica with no
//! demand yet can admit its first clients, and no replica sees itself
//! nearer its threshold than the fleet is. An identity a replica has seen
//! since its last report competes there with its own stake until the next
//! exchange.
//!
//! # What is exact, and what is eventually consistent
//!
//! The shares are those of the reports, at most `syncMs` plus the callout's
//! round trip old, of demands that are already smoothed over several
//! rounds: a shift in where a client's calls arrive is followed within a
//! few exchanges. The capacities of the replicas in one exchange add up to
//! `capacityRps`; two replicas may use exchanges one period apart for a
//! round. A replica publishes its `fleet.maxIdentities` busiest identities;
//! the others compete locally on its share of unused capacity.
//!
//! # Trusting only what can be checked
//!
//! Anyone who reaches Webdis can write to Redis, so an answer is taken only
//! if it could have come from the fleet: every report parses, every member
//! is named `replica~instance` (the instance is a random number each Envoy
//! draws once and keeps in shared data), this replica's own report is in
//! it, and it lists at most `fleet.maxReplicas` members. Anything else is a
//! failed exchange, as if Redis were unreachable. Two Envoys that share a
//! replica name (a Deployment with a fixed `--service-node`) are two
//! members, so the capacity still adds up; once both have been seen for
//! longer than `memberTtlMs` (a restarted Envoy's old self is gone by
//! then), each says so in its log and in `fleet.duplicate_names`. Reports
//! under the cap with false demand are not caught: keep Webdis reachable
//! only by the gateways (policies/stake-qos.md, "Fleet mode").
//!
//! # Failure
//!
//! A callout that fails, answers an error, or does not answer within
//! `fleet.timeoutMs` (measured by the filter itself: Envoy holds a callout
//! to a cluster with no healthy host, and its own timeout does not fire
//! then) leaves the last allocation in place. Once the last good exchange
//! is older than `fleet.staleMs`, the replica falls back to `capacityRps ÷`
//! the fleet size last seen (`fleet.assumeReplicas` before any exchange),
//! with every identity's own stake: the replicas together still admit at
//! most `capacityRps` as long as none joins. The first good exchange
//! restores the fleet shares. A replica that stops reporting leaves the
//! fleet after `memberTtlMs`, and the others' shares grow to cover it.

pub mod exchange;
pub mod policy;

use super::fair::{self, Claim};
use crate::shared::{update, Change, Reader, Record, SharedStore, StoreError};
pub(crate) use policy::FleetDoc;
pub use policy::{is_name, FleetPolicy};
use std::collections::{BTreeMap, HashMap};

/// The allocation this replica last received, in shared data: written by
/// the VM whose callout got the answer, read by every VM at its tick.
pub const FLEET_KEY: &str = "stakegate.stake_qos.v3.fleet";
/// This Envoy's instance number, drawn by its first VM and kept by all.
pub const INSTANCE_KEY: &str = "stakegate.stake_qos.v3.instance";
/// Between a replica's name and its instance in a member's name.
pub const INSTANCE_MARK: char = '~';
/// Unused capacity split evenly among replicas (the rest by demand).
const EVEN_SPARE: f64 = 0.1;
const REPORT_VERSION: u8 = 1;
const VIEW_VERSION: u8 = 1;

/// The Lua script Redis runs for each exchange. KEYS[1] is the fleet's
/// members key, `<name>:members` (its reports are `<name>:report:<member>`:
/// Redis's ACL names the fleet's keys by those shapes); ARGV: this
/// replica's name, the member time to live in ms, its report. Redis's own
/// clock marks who is live, so the replicas' clocks do not matter. Answers
/// `name, report, name, report, ...`.
pub const SCRIPT: &str = "\
local t = redis.call('TIME') \
local now = t[1] * 1000 + math.floor(t[2] / 1000) \
local ttl = tonumber(ARGV[2]) \
local members = KEYS[1] \
local reports = string.sub(members, 1, -9) .. ':report:' \
redis.call('SET', reports .. ARGV[1], ARGV[3], 'PX', ttl) \
redis.call('ZADD', members, now, ARGV[1]) \
redis.call('ZREMRANGEBYSCORE', members, '-inf', now - ttl) \
redis.call('PEXPIRE', members, ttl * 10) \
local out = {} \
for _, name in ipairs(redis.call('ZRANGE', members, 0, -1)) do \
  local report = redis.call('GET', reports .. name) \
  if report then out[#out + 1] = name; out[#out + 1] = report end \
end \
return out";

/// The SHA-1 of `SCRIPT`, by which the gateways run it (`EVALSHA`): the
/// engine's account may run only scripts an operator loaded (`SCRIPT
/// LOAD`), so a holder of its credentials cannot run a script of its own.
/// The stack's engine checks it against what Redis says when it loads it.
pub const SCRIPT_SHA1: &str = "6df0960096690af3aa5e64700ed2045a188b0244";

impl FleetPolicy {
    /// Whether round `round` sends an exchange: every `syncMs`, on the
    /// grid of refill intervals.
    pub fn due(&self, round: u64, refill_interval_ms: u64) -> bool {
        round.is_multiple_of(self.sync_ms.div_ceil(refill_interval_ms).max(1))
    }

    /// The Webdis request body (POSTed to `/`) that stores `report` as
    /// `member`'s (`member_name`) and answers every live member's.
    pub fn request(&self, member: &str, report: &Report) -> Vec<u8> {
        let mut body = format!("EVALSHA/{SCRIPT_SHA1}").into_bytes();
        body.extend(format!("/1/{}:members/{member}/{}/", self.name, self.member_ttl_ms).bytes());
        body.extend(report.encode_hex());
        body
    }
}

/// The environment variable that holds Webdis's credentials,
/// `user:password`; Envoy passes it to the filter's VM
/// (`vm_config.environment_variables.host_env_keys`), so that no policy
/// file holds it.
pub const AUTH_ENV: &str = "STAKEGATE_FLEET_AUTH";

/// The `authorization` header for `credentials` (`user:password`), as
/// Webdis's `http_basic_auth` ACL reads it.
pub fn basic_authorization(credentials: &str) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::from("Basic ");
    for chunk in credentials.as_bytes().chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A member's name in the fleet: the replica's, then its Envoy's instance.
pub fn member_name(replica: &str, instance: u64) -> String {
    format!("{replica}{INSTANCE_MARK}{instance:016x}")
}

/// The replica name of a member's, if it is one: `name~16 hex digits`.
pub fn replica_of(member: &str) -> Option<&str> {
    let (name, instance) = member.split_once(INSTANCE_MARK)?;
    let hex = instance.len() == 16 && instance.bytes().all(|b| b.is_ascii_hexdigit());
    (hex && is_name(name)).then_some(name)
}

/// This Envoy's instance number: the one in shared data, or `drawn` if
/// none is yet (the first VM to ask writes it).
pub fn instance(store: &impl SharedStore, drawn: u64) -> Result<u64, StoreError> {
    let updated = update(store, INSTANCE_KEY, |kept: &mut Instance| match kept.0 {
        Some(n) => Change::Keep(n),
        None => {
            kept.0 = Some(drawn);
            Change::Write(drawn)
        }
    })
    .map_err(|(e, _)| e)?;
    Ok(updated.value)
}

/// The instance record: 8 bytes, or nothing yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Instance(Option<u64>);

impl Record for Instance {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        match bytes.len() {
            0 => Ok(Self(None)),
            8 => Ok(Self(Some(Reader(bytes).u64()))),
            n => Err(format!(
                "shared instance record has {n} bytes, this module reads 8"
            )),
        }
    }

    fn encode(&self) -> Vec<u8> {
        self.0.map_or_else(Vec::new, |n| n.to_le_bytes().to_vec())
    }
}

/// Replica names that more than one member reports under.
pub fn duplicate_names(reports: &[(String, Report)]) -> Vec<String> {
    let mut names: Vec<&str> = reports.iter().filter_map(|(m, _)| replica_of(m)).collect();
    names.sort_unstable();
    let mut duplicates: Vec<String> = names
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0].to_string())
        .collect();
    duplicates.dedup();
    duplicates
}

/// One active identity in a replica's report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    pub key: u64,
    pub stake: u64,
    /// Calls per second (admitted or refused), smoothed.
    pub rps: f32,
}

/// A replica's report: its busiest active identities.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report(pub Vec<Demand>);

impl Report {
    /// Keeps the `max` busiest (ties by key, so every replica keeps the
    /// same).
    pub fn keep_busiest(&mut self, max: usize) {
        if self.0.len() > max {
            self.0
                .sort_unstable_by(|a, b| b.rps.total_cmp(&a.rps).then(a.key.cmp(&b.key)));
            self.0.truncate(max);
        }
    }

    /// Hex of: version, then 20 bytes per identity (key, stake, rps as
    /// f32), little-endian.
    pub fn encode_hex(&self) -> Vec<u8> {
        let mut bytes = vec![REPORT_VERSION];
        for d in &self.0 {
            bytes.extend_from_slice(&d.key.to_le_bytes());
            bytes.extend_from_slice(&d.stake.to_le_bytes());
            bytes.extend_from_slice(&d.rps.to_le_bytes());
        }
        let mut out = Vec::with_capacity(bytes.len() * 2);
        for b in bytes {
            out.extend(format!("{b:02x}").bytes());
        }
        out
    }

    pub fn decode_hex(text: &str) -> Result<Self, String> {
        let digits = text.as_bytes();
        if !digits.len().is_multiple_of(2) || !digits.iter().all(u8::is_ascii_hexdigit) {
            return Err("a report is hex digits in pairs".into());
        }
        let bytes: Vec<u8> = digits
            .chunks_exact(2)
            .map(|pair| {
                let text = std::str::from_utf8(pair).unwrap_or("00");
                u8::from_str_radix(text, 16).unwrap_or(0)
            })
            .collect();
        let Some((&version, entries)) = bytes.split_first() else {
            return Err("an empty report".into());
        };
        if version != REPORT_VERSION || entries.len() % 20 != 0 {
            return Err(format!(
                "a report of version {version} and {} bytes; this module reads version {REPORT_VERSION}, 20 bytes an identity",
                entries.len()
            ));
        }
        Ok(Self(
            entries
                .chunks_exact(20)
                .map(|e| {
                    let mut r = Reader(e);
                    let (key, stake) = (r.u64(), r.u64());
                    let rps = f32::from_bits(r.u32());
                    Demand {
                        key,
                        stake,
                        rps: if rps.is_finite() { rps.max(0.0) } else { 0.0 },
                    }
                })
                .collect(),
        ))
    }
}

/// Reads Webdis's JSON answer to the script: `{"EVALSHA": [name, report,
/// ...]}`, or `{"EVALSHA": [false, "ERR ..."]}` when Redis refused it.
pub fn parse_answer(body: &[u8]) -> Result<Vec<(String, Report)>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("Webdis answered no JSON: {e}"))?;
    let Some(list) = value.get("EVALSHA").and_then(|v| v.as_array()) else {
        return Err(format!("Webdis answered {}", clip(body)));
    };
    if list.first().is_some_and(serde_json::Value::is_boolean) {
        if String::from_utf8_lossy(body).contains("NOSCRIPT") {
            return Err(format!(
                "Redis does not have the fleet's script {SCRIPT_SHA1}: load it after each start of Redis (policies/stake-qos.md, \"Fleet mode\")"
            ));
        }
        return Err(format!("Redis refused the exchange: {}", clip(body)));
    }
    let texts: Vec<&str> = list.iter().filter_map(|v| v.as_str()).collect();
    if texts.len() != list.len() || !texts.len().is_multiple_of(2) {
        return Err(format!("Webdis answered {}", clip(body)));
    }
    texts
        .chunks_exact(2)
        .map(|pair| {
            if replica_of(pair[0]).is_none() {
                let name: String = pair[0].chars().take(80).collect();
                return Err(format!(
                    "a member named {name:?}, not replica~instance: something else writes to the fleet's keys"
                ));
            }
            let report =
                Report::decode_hex(pair[1]).map_err(|e| format!("replica {:?}: {e}", pair[0]))?;
            Ok((pair[0].to_string(), report))
        })
        .collect()
}

fn clip(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
    format!("{text:?}")
}

/// What one exchange gave this replica, kept in shared data (`FLEET_KEY`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetView {
    /// When the exchange was sent (this Envoy's clock, ms): a late answer
    /// to an older exchange does not replace a newer one.
    pub asked_ms: u64,
    /// When its answer arrived; 0: never.
    pub answered_ms: u64,
    /// Live replicas, this one included.
    pub replicas: u32,
    /// This replica's part of the fleet's capacity.
    pub capacity_rps: f64,
    /// The fleet's demand, calls per second.
    pub fleet_demand_rps: f64,
    /// Each of this replica's identities' part of its fleet-wide demand
    /// (`d_r / D`), by key.
    pub fractions: Vec<(u64, f32)>,
}

impl Record for FleetView {
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        const HEAD: usize = 1 + 8 + 8 + 4 + 8 + 8;
        if bytes[0] != VIEW_VERSION
            || bytes.len() < HEAD
            || !(bytes.len() - HEAD).is_multiple_of(12)
        {
            return Err(format!(
                "shared fleet view has version {} and {} bytes, this module reads version {VIEW_VERSION}",
                bytes[0],
                bytes.len()
            ));
        }
        let mut r = Reader(&bytes[1..]);
        let mut view = Self {
            asked_ms: r.u64(),
            answered_ms: r.u64(),
            replicas: r.u32(),
            capacity_rps: r.f64(),
            fleet_demand_rps: r.f64(),
            fractions: Vec::with_capacity((bytes.len() - HEAD) / 12),
        };
        while !r.0.is_empty() {
            let key = r.u64();
            view.fractions.push((key, f32::from_bits(r.u32())));
        }
        Ok(view)
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = vec![VIEW_VERSION];
        out.extend_from_slice(&self.asked_ms.to_le_bytes());
        out.extend_from_slice(&self.answered_ms.to_le_bytes());
        out.extend_from_slice(&self.replicas.to_le_bytes());
        out.extend_from_slice(&self.capacity_rps.to_le_bytes());
        out.extend_from_slice(&self.fleet_demand_rps.to_le_bytes());
        for (key, fraction) in &self.fractions {
            out.extend_from_slice(&key.to_le_bytes());
            out.extend_from_slice(&fraction.to_le_bytes());
        }
        out
    }
}

/// The fleet allocation for replica `me` from every live replica's report
/// (`me` among them), over the fleet's `capacity_rps`.
pub fn allocate(
    capacity_rps: f64,
    reports: &[(String, Report)],
    me: &str,
    asked_ms: u64,
    answered_ms: u64,
) -> FleetView {
    // Fleet-wide demand and stake per identity, in key order so every
    // replica sums in the same order.
    let mut fleet: BTreeMap<u64, (f64, u64)> = BTreeMap::new();
    let mut by_replica = Vec::with_capacity(reports.len());
    for (name, report) in reports {
        let mut sum = 0.0;
        for d in &report.0 {
            let entry = fleet.entry(d.key).or_insert((0.0, d.stake));
            entry.0 += f64::from(d.rps);
            sum += f64::from(d.rps);
        }
        by_replica.push((name.as_str(), sum));
    }
    let claims: Vec<Claim> = fleet
        .values()
        .map(|&(demand, stake)| Claim {
            demand,
            weight: stake.max(1) as f64,
        })
        .collect();
    let level = fair::level(&claims, capacity_rps);
    let share: HashMap<u64, (f64, f64)> = fleet
        .iter()
        .zip(&claims)
        .map(|((&key, &(demand, _)), claim)| (key, (demand, fair::part(claim, level))))
        .collect();
    let allocated: f64 = share.values().map(|&(_, a)| a).sum();
    let spare = (capacity_rps - allocated).max(0.0);
    let fleet_demand: f64 = by_replica.iter().map(|&(_, sum)| sum).sum();
    let replicas = reports.len().max(1);
    let mine = reports.iter().find(|(name, _)| name == me);
    let my_demand = by_replica
        .iter()
        .find(|&&(name, _)| name == me)
        .map_or(0.0, |&(_, sum)| sum);
    let spare_part = if fleet_demand > 0.0 {
        (1.0 - EVEN_SPARE) * my_demand / fleet_demand + EVEN_SPARE / replicas as f64
    } else {
        1.0 / replicas as f64
    };
    let mut capacity = spare * spare_part;
    let mut fractions = Vec::new();
    for d in mine.map_or(&[][..], |(_, r)| &r.0[..]) {
        let Some(&(demand, part)) = share.get(&d.key) else {
            continue;
        };
        if demand > 0.0 {
            let fraction = f64::from(d.rps) / demand;
            capacity += part * fraction;
            fractions.push((d.key, fraction as f32));
        }
    }
    fractions.sort_unstable_by_key(|&(key, _)| key);
    FleetView {
        asked_ms,
        answered_ms,
        replicas: replicas as u32,
        capacity_rps: capacity,
        fleet_demand_rps: fleet_demand,
        fractions,
    }
}

/// What a round in fleet mode leaves for the exchange and the metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoundFleet {
    /// This replica's active identities' demand.
    pub report: Report,
    /// Live replicas as last seen.
    pub replicas: u32,
    /// The round used the fallback share.
    pub fallback: bool,
}

/// What a round uses of the fleet: this replica's capacity and each
/// identity's weight factor, or the fallback.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetShare {
    pub capacity_rps: f64,
    /// `d_r / D` by key; an identity not in it weighs its own stake.
    pub fractions: HashMap<u64, f32>,
    /// Live replicas as last seen.
    pub replicas: u32,
    /// No exchange newer than `staleMs`: capacity ÷ replicas.
    pub fallback: bool,
}

impl FleetShare {
    pub fn of(view: &FleetView, policy: &FleetPolicy, capacity_rps: f64, now_ms: u64) -> Self {
        let fresh =
            view.answered_ms != 0 && now_ms.saturating_sub(view.answered_ms) <= policy.stale_ms;
        if fresh {
            return Self {
                capacity_rps: view.capacity_rps,
                fractions: view.fractions.iter().copied().collect(),
                replicas: view.replicas,
                fallback: false,
            };
        }
        let replicas = if view.replicas == 0 {
            policy.assume_replicas
        } else {
            view.replicas
        };
        Self {
            capacity_rps: capacity_rps / f64::from(replicas.max(1)),
            fractions: HashMap::new(),
            replicas,
            fallback: true,
        }
    }

    /// An identity's weight in this replica's round.
    pub fn weight(&self, key: u64, stake: u64) -> f64 {
        let fraction = self.fractions.get(&key).map_or(1.0, |&f| f64::from(f));
        stake.max(1) as f64 * fraction
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(entries: &[(u64, u64, f32)]) -> Report {
        Report(
            entries
                .iter()
                .map(|&(key, stake, rps)| Demand { key, stake, rps })
                .collect(),
        )
    }

    fn policy(json: &str) -> Result<FleetPolicy, crate::validate::PolicyError> {
        let doc: FleetDoc = serde_json::from_str(json).unwrap();
        FleetPolicy::compile(doc, 20, &mut crate::validate::Fields::default())
    }

    #[test]
    fn each_replica_gives_out_the_part_of_a_share_its_demand_brings() {
        // One client only on replica 1, two on all three; equal stakes,
        // each offering 300 calls/s against 300 of capacity.
        let reports = vec![
            (
                "r1".to_string(),
                report(&[(1, 1, 300.0), (2, 1, 100.0), (3, 1, 100.0)]),
            ),
            ("r2".to_string(), report(&[(2, 1, 100.0), (3, 1, 100.0)])),
            ("r3".to_string(), report(&[(2, 1, 100.0), (3, 1, 100.0)])),
        ];
        let views: Vec<FleetView> = ["r1", "r2", "r3"]
            .iter()
            .map(|me| allocate(300.0, &reports, me, 1, 2))
            .collect();
        let total: f64 = views.iter().map(|v| v.capacity_rps).sum();
        assert!((total - 300.0).abs() < 1e-6, "{total}");
        // Each client's fleet share is 100: all of client 1's on replica 1,
        // a third of the others' on each.
        assert!((views[0].capacity_rps - (100.0 + 100.0 / 3.0 * 2.0)).abs() < 1e-6);
        assert!((views[1].capacity_rps - 200.0 / 3.0).abs() < 1e-6);
        assert_eq!(views[0].fractions[0], (1, 1.0));
        assert!((views[1].fractions[0].1 - 1.0 / 3.0).abs() < 1e-6);
        // The local round's rule with these weights gives the fleet share:
        // replica 1 splits its capacity 100 : 33.3 : 33.3.
        let share = FleetShare::of(&views[0], &policy("{}").unwrap(), 300.0, 2);
        let claims: Vec<Claim> = reports[0]
            .1
             .0
            .iter()
            .map(|d| Claim {
                demand: f64::from(d.rps),
                weight: share.weight(d.key, d.stake),
            })
            .collect();
        let parts = fair::shares(&claims, share.capacity_rps);
        for (part, want) in parts.iter().zip([100.0, 100.0 / 3.0, 100.0 / 3.0]) {
            assert!((part - want).abs() < 1e-4, "{parts:?}");
        }
    }

    #[test]
    fn unused_capacity_follows_demand_with_a_tenth_split_evenly() {
        let reports = vec![
            ("a".to_string(), report(&[(1, 1, 30.0)])),
            ("b".to_string(), report(&[])),
        ];
        let a = allocate(100.0, &reports, "a", 1, 2);
        let b = allocate(100.0, &reports, "b", 1, 2);
        assert!((a.capacity_rps + b.capacity_rps - 100.0).abs() < 1e-9);
        // 30 used, 70 spare: 0.9 of it by demand (all a's), 0.1 evenly.
        assert!((b.capacity_rps - 3.5).abs() < 1e-9, "{b:?}");
        assert_eq!(a.fleet_demand_rps, 30.0);
        // Nobody busy: even shares.
        let idle = vec![("a".into(), report(&[])), ("b".into(), report(&[]))];
        assert_eq!(allocate(100.0, &idle, "b", 1, 2).capacity_rps, 50.0);
    }

    #[test]
    fn a_stale_view_falls_back_to_capacity_over_the_fleet_last_seen() {
        let p = policy(r#"{"syncMs": 100, "timeoutMs": 100, "assumeReplicas": 2}"#).unwrap();
        assert_eq!(p.stale_ms, 600);
        let never = FleetShare::of(&FleetView::default(), &p, 300.0, 5);
        assert!(never.fallback);
        assert_eq!((never.capacity_rps, never.replicas), (150.0, 2));
        let view = FleetView {
            answered_ms: 1000,
            replicas: 3,
            capacity_rps: 250.0,
            fractions: vec![(7, 0.5)],
            ..FleetView::default()
        };
        let fresh = FleetShare::of(&view, &p, 300.0, 1600);
        assert!(!fresh.fallback);
        assert_eq!(fresh.capacity_rps, 250.0);
        assert_eq!(fresh.weight(7, 4), 2.0);
        assert_eq!(fresh.weight(8, 4), 4.0);
        let stale = FleetShare::of(&view, &p, 300.0, 1601);
        assert!(stale.fallback);
        assert_eq!(stale.capacity_rps, 100.0);
        assert_eq!(stale.weight(7, 4), 4.0);
    }

    #[test]
    fn reports_views_and_answers_round_trip() {
        let mut r = report(&[(1, 10, 5.0), (2, 20, 50.0), (3, 30, 7.5)]);
        let hex = String::from_utf8(r.encode_hex()).unwrap();
        assert_eq!(Report::decode_hex(&hex).unwrap(), r);
        r.keep_busiest(2);
        assert_eq!(r.0.iter().map(|d| d.key).collect::<Vec<_>>(), [2, 3]);
        let view = allocate(10.0, &[("x".into(), r.clone())], "x", 3, 4);
        assert_eq!(FleetView::decode(&view.encode()).unwrap(), view);
        let (x, y) = (member_name("x", 1), member_name("y", 2));
        let body = format!(r#"{{"EVALSHA": ["{x}", "{hex}", "{y}", "01"]}}"#);
        let answer = parse_answer(body.as_bytes()).unwrap();
        assert_eq!(answer[0].1 .0.len(), 3);
        assert_eq!(answer[1], (y.clone(), Report::default()));
        for (bad, why) in [
            (
                r#"{"EVALSHA":[false,"ERR no script"]}"#.to_string(),
                "Redis refused",
            ),
            (
                r#"{"EVALSHA":[false,"NOSCRIPT No matching script."]}"#.to_string(),
                "load it after each start of Redis",
            ),
            (r#"{"GET":"x"}"#.into(), "Webdis answered"),
            (format!(r#"{{"EVALSHA":["{x}"]}}"#), "Webdis answered"),
            (
                format!(r#"{{"EVALSHA":["{x}","0"]}}"#),
                "hex digits in pairs",
            ),
            (format!(r#"{{"EVALSHA":["{x}","02"]}}"#), "version 2"),
            (r#"{"EVALSHA":["x","01"]}"#.into(), "not replica~instance"),
            (
                r#"{"EVALSHA":["x~12","01"]}"#.into(),
                "not replica~instance",
            ),
            ("<html>".into(), "no JSON"),
        ] {
            let e = parse_answer(bad.as_bytes()).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn members_are_replicas_of_an_instance_and_one_name_twice_is_told() {
        let store = crate::shared::MemoryStore::default();
        assert_eq!(instance(&store, 7).unwrap(), 7, "the first VM's number");
        assert_eq!(instance(&store, 9).unwrap(), 7, "kept for every other");
        assert_eq!(replica_of(&member_name("gw-1", 7)), Some("gw-1"));
        let reports: Vec<(String, Report)> = [("gw-1", 1), ("gw-2", 2), ("gw-1", 3)]
            .iter()
            .map(|(n, i)| (member_name(n, *i), Report::default()))
            .collect();
        assert_eq!(duplicate_names(&reports), ["gw-1"]);
        assert!(duplicate_names(&reports[..2]).is_empty());
        // One name twice is two replicas: each gets half of what is idle.
        let view = allocate(
            300.0,
            &reports[..1]
                .iter()
                .chain(&reports[2..])
                .cloned()
                .collect::<Vec<_>>(),
            &reports[0].0,
            1,
            2,
        );
        assert_eq!((view.replicas, view.capacity_rps), (2, 150.0));
    }

    #[test]
    fn credentials_are_sent_as_http_basic_auth() {
        assert_eq!(basic_authorization("sg:s3cret"), "Basic c2c6czNjcmV0");
        assert_eq!(basic_authorization("a:b"), "Basic YTpi");
        assert_eq!(basic_authorization("ab:"), "Basic YWI6");
        assert_eq!(basic_authorization("user:pa"), "Basic dXNlcjpwYQ==");
    }

    #[test]
    fn the_request_is_one_evalsha_webdis_can_split_on_slashes() {
        let p = policy(r#"{"name": "main", "memberTtlMs": 900}"#).unwrap();
        let body = String::from_utf8(p.request("gw-1", &report(&[(1, 1, 1.0)]))).unwrap();
        let parts: Vec<&str> = body.split('/').collect();
        assert_eq!(parts[0], "EVALSHA");
        assert_eq!(parts[1], SCRIPT_SHA1);
        assert_eq!(&parts[2..6], ["1", "main:members", "gw-1", "900"]);
        assert_eq!(parts.len(), 7);
    }

    #[test]
    fn settings_are_checked_with_the_field_named() {
        for (json, field) in [
            (r#"{"replica": "gw/1"}"#, "fleet.replica"),
            (r#"{"name": ""}"#, "fleet.name"),
            (r#"{"cluster": ""}"#, "fleet.cluster"),
            (r#"{"syncMs": 5}"#, "fleet.syncMs"),
            (r#"{"timeoutMs": 5}"#, "fleet.timeoutMs"),
            (r#"{"staleMs": 100}"#, "fleet.staleMs"),
            (r#"{"memberTtlMs": 100}"#, "fleet.memberTtlMs"),
            (r#"{"assumeReplicas": 0}"#, "fleet.assumeReplicas"),
        ] {
            assert_eq!(policy(json).unwrap_err().field, field, "{json}");
        }
        let p = policy("{}").unwrap();
        assert_eq!(
            (p.sync_ms, p.timeout_ms, p.stale_ms, p.member_ttl_ms),
            (100, 250, 750, 1000)
        );
        assert!(p.due(10, 20) && !p.due(11, 20));
    }
}
