//! Who a request is from, and what it weighs.
//!
//! The policy's `identity.order` lists the sources tried in turn:
//!
//! 1. `apiKey`: the configured header; its sha256 must be in the stake table
//!    (policy files hold hashes, never keys). An unknown key falls through.
//! 2. `peerCertificate`: the mTLS peer certificate's URI SAN, else its
//!    subject, looked up in the stake table. Unknown peers fall through.
//! 3. `address`: an unstaked client, keyed by its address grouped to a
//!    prefix (`/32` and `/64` by default; `/24` stops a client that rotates
//!    through a subnet from gaining anything). The address is
//!    `source.address`, or, when that is a trusted proxy, the rightmost
//!    `x-forwarded-for` hop that is not a trusted proxy.
//!
//! Unstaked clients weigh `unstakedStake` (1000); so does any smaller stake,
//! since that is also the floor for staked ones (docs/background.md part 2).

use crate::qos::policy::{QosPolicy, Source, StakeEntry, TIER_UNSTAKED};
use crate::request::{sha256_hex, Cidr, RequestFacts};
use std::net::IpAddr;
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The table key: a hash of `kind:value`, never 0.
    pub key: u64,
    pub stake: u64,
    /// Index into the policy's tiers.
    pub tier: usize,
    /// In the stake table (it is not evicted to make room for unstaked ones).
    pub staked: bool,
    /// Its name in the stake table; `None` for an unstaked one.
    pub name: Option<Arc<str>>,
    /// An unstaked one's address group: its network and prefix.
    pub address: Option<(IpAddr, u8)>,
}

impl Identity {
    /// Its name for an operator: the stake table's, or `unstaked`.
    pub fn shown(&self) -> &str {
        self.name.as_deref().unwrap_or("unstaked")
    }
}

/// Resolves the request's identity; `None` only when no source applies and
/// the address is unknown. A source the stake table has no entry for is not
/// read at all: each fact is a host call, and the request pays for it.
pub fn identify(policy: &QosPolicy, facts: &mut impl RequestFacts) -> Option<Identity> {
    for source in &policy.order {
        let found = match source {
            Source::ApiKey if policy.by_api_key.is_empty() => None,
            Source::PeerCertificate if policy.by_peer.is_empty() => None,
            Source::ApiKey => facts
                .header(&policy.api_key_header)
                .map(|key| sha256_hex(key.as_bytes()))
                .and_then(|hash| Some((format!("key:{hash}"), policy.by_api_key.get(&hash)?))),
            Source::PeerCertificate => [facts.peer_uri_san(), facts.peer_subject()]
                .into_iter()
                .flatten()
                .find_map(|peer| Some((format!("peer:{peer}"), policy.by_peer.get(&peer)?))),
            Source::Address => {
                return client_ip(policy, facts).map(|ip| unstaked(policy, ip));
            }
        };
        if let Some((name, entry)) = found {
            return Some(staked(policy, &name, entry));
        }
    }
    None
}

/// The staked identity the request's API key names, if the stake table
/// has it: what QoS reads of a request it only counts (`light`), so that
/// the gate after it can give a staked caller priority
/// (`request::STAKED_PROPERTY`) and the usage ledger can name its calls.
/// One header read, and a hash if the header is there; no read with no key
/// in the table.
pub fn staked_by_key(policy: &QosPolicy, facts: &mut impl RequestFacts) -> Option<Identity> {
    if policy.by_api_key.is_empty() {
        return None;
    }
    let hash = sha256_hex(facts.header(&policy.api_key_header)?.as_bytes());
    let entry = policy.by_api_key.get(&hash)?;
    Some(staked(policy, &format!("key:{hash}"), entry))
}

/// A request with no usable source at all: one shared unstaked identity.
pub fn anonymous(policy: &QosPolicy) -> Identity {
    Identity {
        key: key_of("anonymous"),
        stake: policy.unstaked_stake,
        tier: TIER_UNSTAKED,
        staked: false,
        name: None,
        address: None,
    }
}

fn staked(policy: &QosPolicy, name: &str, entry: &StakeEntry) -> Identity {
    Identity {
        key: key_of(name),
        stake: entry.stake.max(policy.unstaked_stake),
        tier: entry.tier,
        staked: true,
        name: Some(entry.name.clone()),
        address: None,
    }
}

fn unstaked(policy: &QosPolicy, ip: IpAddr) -> Identity {
    let (bits, prefix, width) = match ip {
        IpAddr::V4(v4) => (u128::from(u32::from(v4)), policy.group_ipv4_prefix, 32),
        IpAddr::V6(v6) => (u128::from(v6), policy.group_ipv6_prefix, 128),
    };
    let network = bits & (u128::MAX << (width - u32::from(prefix)));
    let net = match ip {
        IpAddr::V4(_) => IpAddr::from(std::net::Ipv4Addr::from(network as u32)),
        IpAddr::V6(_) => IpAddr::from(std::net::Ipv6Addr::from(network)),
    };
    Identity {
        key: key_of(&format!("addr:{width}:{network:x}/{prefix}")),
        stake: policy.unstaked_stake,
        tier: TIER_UNSTAKED,
        staked: false,
        name: None,
        address: Some((net, prefix)),
    }
}

/// `source.address`, or behind trusted proxies the rightmost untrusted
/// `x-forwarded-for` hop. A malformed hop ends the walk at the last good
/// one, so a client cannot pick its identity by sending garbage.
pub fn client_ip(policy: &QosPolicy, facts: &mut impl RequestFacts) -> Option<IpAddr> {
    let source = facts.source_ip()?;
    let trusted = |ip: IpAddr, proxies: &[Cidr]| proxies.iter().any(|c| c.contains(ip));
    if !trusted(source, &policy.trusted_proxies) {
        return Some(source);
    }
    let Some(forwarded) = facts.header("x-forwarded-for") else {
        return Some(source);
    };
    let mut client = source;
    for hop in forwarded.rsplit(',') {
        let Ok(ip) = hop.trim().parse::<IpAddr>() else {
            break;
        };
        client = ip;
        if !trusted(ip, &policy.trusted_proxies) {
            break;
        }
    }
    Some(client)
}

/// FNV-1a, 64 bits; 0 marks an empty table entry, so it is never a key.
fn key_of(name: &str) -> u64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    hash.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::MetadataScope;

    #[derive(Default)]
    struct Facts {
        ip: Option<IpAddr>,
        headers: Vec<(&'static str, String)>,
        san: Option<String>,
        /// What was read, in order.
        reads: Vec<String>,
    }

    impl RequestFacts for Facts {
        fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
            None
        }
        fn source_ip(&mut self) -> Option<IpAddr> {
            self.reads.push("address".into());
            self.ip
        }
        fn peer_uri_san(&mut self) -> Option<String> {
            self.reads.push("peer".into());
            self.san.clone()
        }
        fn header(&mut self, name: &str) -> Option<String> {
            self.reads.push(name.into());
            self.headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
        }
    }

    fn policy(extra: &str) -> QosPolicy {
        let json = format!(
            r#"{{"capacityRps": 100, {extra} "stakes": [
                {{"apiKeySha256": "{}", "name": "acme", "stake": 5000000, "tier": "gold"}},
                {{"peer": "spiffe://validator/1", "name": "v1", "stake": 10}}]}}"#,
            sha256_hex(b"acme-secret")
        );
        QosPolicy::parse(json.as_bytes()).unwrap()
    }

    fn from(ip: &str) -> Facts {
        Facts {
            ip: Some(ip.parse().unwrap()),
            ..Facts::default()
        }
    }

    #[test]
    fn a_known_api_key_is_staked_and_an_unknown_one_falls_to_the_address() {
        let p = policy("");
        let mut facts = from("203.0.113.9");
        facts.headers.push(("x-api-key", "acme-secret".into()));
        let id = identify(&p, &mut facts).unwrap();
        assert!(id.staked);
        assert_eq!((id.stake, p.tiers[id.tier].as_str()), (5_000_000, "gold"));

        let mut stranger = from("203.0.113.9");
        stranger.headers.push(("x-api-key", "guess".into()));
        let id = identify(&p, &mut stranger).unwrap();
        assert!(!id.staked);
        assert_eq!(id, identify(&p, &mut from("203.0.113.9")).unwrap());
    }

    #[test]
    fn peer_san_is_staked_with_the_unstaked_floor() {
        let p = policy("");
        let mut facts = from("10.1.1.1");
        facts.san = Some("spiffe://validator/1".into());
        let id = identify(&p, &mut facts).unwrap();
        assert!(id.staked);
        assert_eq!(
            id.stake, 1000,
            "a stake under unstakedStake is raised to it"
        );
    }

    #[test]
    fn sources_with_no_stake_entries_are_not_read() {
        let plain = QosPolicy::parse(br#"{"capacityRps": 100}"#).unwrap();
        let mut facts = from("203.0.113.9");
        identify(&plain, &mut facts).unwrap();
        assert_eq!(facts.reads, ["address"]);

        let keys_only = QosPolicy::parse(
            format!(
                r#"{{"capacityRps": 100, "stakes": [{{"apiKeySha256": "{}", "name": "a", "stake": 5}}]}}"#,
                sha256_hex(b"k")
            )
            .as_bytes(),
        )
        .unwrap();
        let mut facts = from("203.0.113.9");
        identify(&keys_only, &mut facts).unwrap();
        assert_eq!(facts.reads, ["x-api-key", "address"]);

        let mut facts = from("203.0.113.9");
        identify(&policy(""), &mut facts).unwrap();
        assert_eq!(facts.reads, ["x-api-key", "peer", "address"]);
    }

    #[test]
    fn addresses_group_by_prefix() {
        let p = policy(r#""identity": {"groupIpv4Prefix": 24},"#);
        let a = identify(&p, &mut from("198.51.100.7")).unwrap();
        let b = identify(&p, &mut from("198.51.100.200")).unwrap();
        let c = identify(&p, &mut from("198.51.101.7")).unwrap();
        assert_eq!(a, b);
        assert_ne!(a.key, c.key);
        let v6 = policy("");
        let x = identify(&v6, &mut from("2001:db8:1:2::1")).unwrap();
        let y = identify(&v6, &mut from("2001:db8:1:2:ffff::9")).unwrap();
        let z = identify(&v6, &mut from("2001:db8:1:3::1")).unwrap();
        assert_eq!(x, y);
        assert_ne!(x.key, z.key);
    }

    #[test]
    fn forwarded_for_counts_only_behind_a_trusted_proxy() {
        let p = policy(r#""identity": {"trustedProxies": ["10.0.0.0/8"]},"#);
        let forwarded = |source: &str, xff: &str| {
            let mut f = from(source);
            f.headers.push(("x-forwarded-for", xff.into()));
            client_ip(&p, &mut f).unwrap().to_string()
        };
        // The rightmost hop that is not one of our proxies is the client.
        assert_eq!(
            forwarded("10.0.0.1", "1.1.1.1, 2.2.2.2, 10.0.0.5"),
            "2.2.2.2"
        );
        // A public client cannot choose its identity with the header.
        assert_eq!(forwarded("203.0.113.1", "2.2.2.2"), "203.0.113.1");
        // Garbage ends the walk at the last good hop.
        assert_eq!(forwarded("10.0.0.1", "1.1.1.1, junk"), "10.0.0.1");
    }
}
