//! Request classes: which requests are internal, priority, or default.
//!
//! A class is decided only from facts a public client cannot forge: the
//! listener or route the request came through (their metadata is Envoy
//! config), the connection's source address, the mTLS peer's URI SAN, or a
//! header that every listener running the gate strips or overwrites before
//! the gate (the policy calls it `strippedHeader` so nobody forgets that
//! condition). The facts are read lazily: a policy with only CIDR matchers
//! never reads a header or metadata.

use std::net::IpAddr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestClass {
    Internal,
    Priority,
    Default,
}

impl RequestClass {
    pub const ALL: [RequestClass; 3] = [
        RequestClass::Internal,
        RequestClass::Priority,
        RequestClass::Default,
    ];

    /// Position in `ALL` (metrics arrays are indexed by it).
    pub fn index(self) -> usize {
        match self {
            RequestClass::Internal => 0,
            RequestClass::Priority => 1,
            RequestClass::Default => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RequestClass::Internal => "internal",
            RequestClass::Priority => "priority",
            RequestClass::Default => "default",
        }
    }
}

/// Where `filter_metadata.stakegate.class` is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetadataScope {
    Listener,
    Route,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Matcher {
    /// `filter_metadata.stakegate.class` of the listener or route equals this.
    Metadata(MetadataScope, String),
    SourceCidr(Cidr),
    UriSan(String),
    UriSanPrefix(String),
    StrippedHeader {
        name: String,
        value: String,
    },
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
}

impl Matcher {
    pub fn matches(&self, facts: &mut impl RequestFacts) -> bool {
        match self {
            Matcher::Metadata(scope, class) => {
                facts.metadata_class(*scope).as_deref() == Some(class)
            }
            Matcher::SourceCidr(cidr) => facts.source_ip().is_some_and(|ip| cidr.contains(ip)),
            Matcher::UriSan(san) => facts.peer_uri_san().as_deref() == Some(san),
            Matcher::UriSanPrefix(prefix) => facts
                .peer_uri_san()
                .is_some_and(|san| san.starts_with(prefix)),
            Matcher::StrippedHeader { name, value } => facts.header(name).as_deref() == Some(value),
        }
    }
}

/// Internal if any internal matcher matches, else priority if any priority
/// matcher does, else default.
pub fn classify(
    internal: &[Matcher],
    priority: &[Matcher],
    facts: &mut impl RequestFacts,
) -> RequestClass {
    if internal.iter().any(|m| m.matches(facts)) {
        RequestClass::Internal
    } else if priority.iter().any(|m| m.matches(facts)) {
        RequestClass::Priority
    } else {
        RequestClass::Default
    }
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

    #[derive(Default)]
    struct Facts {
        listener: Option<String>,
        ip: Option<IpAddr>,
        san: Option<String>,
        header: Option<(String, String)>,
        reads: Vec<&'static str>,
    }

    impl RequestFacts for Facts {
        fn metadata_class(&mut self, scope: MetadataScope) -> Option<String> {
            self.reads.push("metadata");
            match scope {
                MetadataScope::Listener => self.listener.clone(),
                MetadataScope::Route => None,
            }
        }
        fn source_ip(&mut self) -> Option<IpAddr> {
            self.reads.push("ip");
            self.ip
        }
        fn peer_uri_san(&mut self) -> Option<String> {
            self.reads.push("san");
            self.san.clone()
        }
        fn header(&mut self, name: &str) -> Option<String> {
            self.reads.push("header");
            self.header
                .as_ref()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        }
    }

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

    #[test]
    fn internal_wins_over_priority() {
        let internal = vec![Matcher::Metadata(
            MetadataScope::Listener,
            "internal".into(),
        )];
        let priority = vec![Matcher::SourceCidr(cidr("127.0.0.0/8"))];
        let mut facts = Facts {
            listener: Some("internal".into()),
            ip: Some("127.0.0.1".parse().unwrap()),
            ..Facts::default()
        };
        assert_eq!(
            classify(&internal, &priority, &mut facts),
            RequestClass::Internal
        );
        assert_eq!(
            facts.reads,
            vec!["metadata"],
            "priority matchers are not even read"
        );
        let mut facts = Facts {
            ip: Some("127.0.0.1".parse().unwrap()),
            ..Facts::default()
        };
        assert_eq!(
            classify(&internal, &priority, &mut facts),
            RequestClass::Priority
        );
        let mut facts = Facts {
            ip: Some("10.0.0.1".parse().unwrap()),
            ..Facts::default()
        };
        assert_eq!(
            classify(&internal, &priority, &mut facts),
            RequestClass::Default
        );
    }

    #[test]
    fn san_and_header_matchers() {
        let priority = vec![
            Matcher::UriSanPrefix("spiffe://rpc/priority/".into()),
            Matcher::StrippedHeader {
                name: "x-stakegate-class".into(),
                value: "priority".into(),
            },
        ];
        let mut facts = Facts {
            san: Some("spiffe://rpc/priority/exchange-a".into()),
            ..Facts::default()
        };
        assert_eq!(classify(&[], &priority, &mut facts), RequestClass::Priority);
        let mut facts = Facts {
            header: Some(("x-stakegate-class".into(), "priority".into())),
            ..Facts::default()
        };
        assert_eq!(classify(&[], &priority, &mut facts), RequestClass::Priority);
        let mut facts = Facts {
            header: Some(("x-stakegate-class".into(), "internal".into())),
            ..Facts::default()
        };
        assert_eq!(classify(&[], &priority, &mut facts), RequestClass::Default);
    }
}
