//! What a filter can tell about a request, and the address types every
//! policy matches on: the gate's classes, dedup's client scope and stake
//! QoS's identities all read a request through `RequestFacts`, lazily, so
//! a fact nobody asks for costs no host call.

use std::net::IpAddr;

/// Where `filter_metadata.stakegate.class` is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetadataScope {
    Listener,
    Route,
}

/// What the filter can tell about a request, read on demand.
pub trait RequestFacts {
    fn metadata_class(&mut self, scope: MetadataScope) -> Option<String>;
    fn source_ip(&mut self) -> Option<IpAddr>;
    fn peer_uri_san(&mut self) -> Option<String>;
    /// The peer certificate's subject, for hosts that can tell.
    fn peer_subject(&mut self) -> Option<String> {
        None
    }
    fn header(&mut self, name: &str) -> Option<String>;
    /// The upstream cluster the route chose, for hosts that can tell.
    fn route_cluster(&mut self) -> Option<String> {
        None
    }
    /// Whether stake QoS, before this filter, found the caller in its
    /// stake table (`STAKED_PROPERTY`).
    fn staked(&mut self) -> bool {
        false
    }
    /// The caller's identity as stake QoS named it, before this filter
    /// (`IDENTITY_PROPERTY`).
    fn qos_identity(&mut self) -> Option<u64> {
        None
    }
}

/// The property in which stake QoS tells the admission gate after it to
/// hold a WebSocket's data (`1`) while its calls wait for their identity's
/// share, or to let it go (`0`): QoS never holds a socket's data itself
/// (`qos::socket`).
pub const SOCKET_HOLD_PROPERTY: &str = "stakegate_socket_hold";

/// The property in which stake QoS tells the filters after it the
/// caller's identity (its table key, in hex), when it named one: the gate
/// bounds an identity's subscriptions and held requests by it.
pub const IDENTITY_PROPERTY: &str = "stakegate_identity";

/// The property in which stake QoS tells the filters after it that the
/// caller is in its stake table (`1`). Envoy keeps it in the request's
/// filter state, which no client can set.
pub const STAKED_PROPERTY: &str = "stakegate_staked";

/// Reads the body piece (or upgraded stream data) Envoy is handing over.
pub trait Body {
    /// Up to `len` bytes from `start` of the buffered body.
    fn read(&mut self, start: usize, len: usize) -> Vec<u8>;
}

/// A body already read whole.
impl Body for &[u8] {
    fn read(&mut self, start: usize, len: usize) -> Vec<u8> {
        let from = self.get(start..).unwrap_or_default();
        from[..len.min(from.len())].to_vec()
    }
}

/// Requests and bodies for tests.
#[cfg(test)]
pub mod testing {
    use super::{Body, MetadataScope, RequestFacts};
    use std::net::IpAddr;

    /// A body held whole.
    pub struct Bytes(pub Vec<u8>);

    impl Body for Bytes {
        fn read(&mut self, start: usize, len: usize) -> Vec<u8> {
            self.0.get(start..start + len).unwrap_or_default().to_vec()
        }
    }

    /// A public client at 192.0.2.1, with no metadata, certificate or
    /// headers.
    pub struct Public;

    impl RequestFacts for Public {
        fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
            None
        }
        fn source_ip(&mut self) -> Option<IpAddr> {
            "192.0.2.1".parse().ok()
        }
        fn peer_uri_san(&mut self) -> Option<String> {
            None
        }
        fn header(&mut self, _: &str) -> Option<String> {
            None
        }
    }
}

/// `bytes` as policies name a secret they must not hold: its sha256, in
/// lowercase hex (API keys in stake tables, dedup's key scope).
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An IPv4 or IPv6 network, `addr/prefix`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    pub fn parse(text: &str) -> Result<Self, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let network: IpAddr = addr
            .parse()
            .map_err(|_| format!("invalid address {addr:?}"))?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("invalid prefix length {p:?} (0..={max})"))?,
        };
        Ok(Self { network, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4-mapped IPv6 source (::ffff:a.b.c.d) is its IPv4 address.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.network, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => same_prefix(
                u128::from(u32::from(net)) << 96,
                u128::from(u32::from(ip)) << 96,
                self.prefix,
            ),
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                same_prefix(u128::from(net), u128::from(ip), self.prefix)
            }
            _ => false,
        }
    }
}

fn same_prefix(a: u128, b: u128, prefix: u8) -> bool {
    if prefix == 0 {
        return true;
    }
    let mask = u128::MAX << (128 - u32::from(prefix));
    a & mask == b & mask
}

/// Parses Envoy's `source.address` property: `1.2.3.4:5678` or `[::1]:5678`.
pub fn parse_socket_ip(address: &str) -> Option<IpAddr> {
    address
        .parse::<std::net::SocketAddr>()
        .map(|s| s.ip())
        .ok()
        .or_else(|| address.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(text: &str) -> Cidr {
        Cidr::parse(text).unwrap()
    }

    #[test]
    fn cidrs_match_their_networks() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(cidr("10.0.0.0/8").contains(ip("10.200.3.4")));
        assert!(!cidr("10.0.0.0/8").contains(ip("11.0.0.1")));
        assert!(cidr("192.168.1.7").contains(ip("192.168.1.7")));
        assert!(!cidr("192.168.1.7").contains(ip("192.168.1.8")));
        assert!(cidr("0.0.0.0/0").contains(ip("8.8.8.8")));
        assert!(cidr("fd00::/8").contains(ip("fd12::1")));
        assert!(!cidr("fd00::/8").contains(ip("fe80::1")));
        assert!(
            cidr("127.0.0.0/8").contains(ip("::ffff:127.0.0.1")),
            "mapped IPv4"
        );
        assert!(!cidr("::1/128").contains(ip("127.0.0.1")));
    }

    #[test]
    fn bad_cidrs_say_why() {
        assert_eq!(
            Cidr::parse("10.0.0.0/33").unwrap_err(),
            "invalid prefix length \"33\" (0..=32)"
        );
        assert_eq!(
            Cidr::parse("nope/8").unwrap_err(),
            "invalid address \"nope\""
        );
    }

    #[test]
    fn socket_addresses_parse() {
        assert_eq!(
            parse_socket_ip("127.0.0.1:4242"),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(parse_socket_ip("[::1]:4242"), Some("::1".parse().unwrap()));
        assert_eq!(parse_socket_ip("garbage"), None);
    }
}
