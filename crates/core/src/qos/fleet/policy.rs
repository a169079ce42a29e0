//! Fleet mode's settings: the `fleet` section of the stake QoS policy
//! (`policies/stake-qos.md`, "Fleet mode").

use crate::validate::{ensure, range, Fields, PolicyError};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct FleetDoc {
    cluster: Option<String>,
    replica: Option<String>,
    name: Option<String>,
    sync_ms: Option<u64>,
    timeout_ms: Option<u64>,
    stale_ms: Option<u64>,
    member_ttl_ms: Option<u64>,
    assume_replicas: Option<u32>,
    max_identities: Option<u32>,
    max_replicas: Option<u32>,
}

/// Fleet mode's settings (policy `fleet`, see `policies/stake-qos.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct FleetPolicy {
    /// Envoy's cluster for Webdis.
    pub cluster: String,
    /// This replica's name in the fleet; `None`: Envoy's node id.
    pub replica: Option<String>,
    /// The fleet's key prefix in Redis: fleets with other names share
    /// nothing.
    pub name: String,
    pub sync_ms: u64,
    pub timeout_ms: u64,
    pub stale_ms: u64,
    pub member_ttl_ms: u64,
    pub assume_replicas: u32,
    pub max_identities: u32,
    /// An answer listing more members than this is not trusted.
    pub max_replicas: u32,
}

/// A replica or fleet name Redis keys and Webdis paths carry as they are.
pub fn is_name(text: &str) -> bool {
    (1..=64).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn name(field: &str, text: String) -> Result<String, PolicyError> {
    ensure(is_name(&text), field, || {
        format!("must be 1-64 characters of A-Z, a-z, 0-9, _ or -; got {text:?}")
    })?;
    Ok(text)
}

impl FleetPolicy {
    pub(crate) fn compile(
        doc: FleetDoc,
        refill_interval_ms: u64,
        f: &mut Fields,
    ) -> Result<Self, PolicyError> {
        let cluster = f.or("fleet.cluster", doc.cluster, "stakegate_fleet".into());
        ensure(
            !cluster.is_empty()
                && cluster.len() <= 256
                && cluster.bytes().all(|b| b.is_ascii_graphic()),
            "fleet.cluster",
            || format!("must be the name of a cluster in Envoy's config; got {cluster:?}"),
        )?;
        let replica = f.or_else(
            "fleet.replica",
            doc.replica.map(Some),
            "Envoy's node id",
            || None,
        );
        let replica = replica.map(|r| name("fleet.replica", r)).transpose()?;
        let fleet_name = name(
            "fleet.name",
            f.or("fleet.name", doc.name, "stakegate".into()),
        )?;
        let sync_ms = f.range("fleet.syncMs", doc.sync_ms, 100, refill_interval_ms, 10_000)?;
        let timeout_ms = f.range("fleet.timeoutMs", doc.timeout_ms, 250, 10, 10_000)?;
        let stale_ms = f.or_else(
            "fleet.staleMs",
            doc.stale_ms,
            "5 × syncMs + timeoutMs",
            || 5 * sync_ms + timeout_ms,
        );
        let stale_ms = range("fleet.staleMs", stale_ms, sync_ms + timeout_ms, 600_000)?;
        let member_ttl_ms = f.or_else(
            "fleet.memberTtlMs",
            doc.member_ttl_ms,
            "10 × syncMs",
            || 10 * sync_ms,
        );
        let member_ttl_ms = range("fleet.memberTtlMs", member_ttl_ms, 2 * sync_ms, 600_000)?;
        Ok(Self {
            cluster,
            replica,
            name: fleet_name,
            sync_ms,
            timeout_ms,
            stale_ms,
            member_ttl_ms,
            assume_replicas: f.range("fleet.assumeReplicas", doc.assume_replicas, 1, 1, 1000)?,
            max_replicas: f.range("fleet.maxReplicas", doc.max_replicas, 16, 2, 1000)?,
            max_identities: f.range("fleet.maxIdentities", doc.max_identities, 2048, 1, 100_000)?,
        })
    }
}
