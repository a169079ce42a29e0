//! Request classes: which requests are internal, priority, or default.
//!
//! A class is decided only from facts a public client cannot forge: the
//! listener or route the request came through (their metadata is Envoy
//! config), the connection's source address, the mTLS peer's URI SAN, or a
//! header that every listener running the gate strips or overwrites before
//! the gate (the policy calls it `strippedHeader` so nobody forgets that
//! condition), or stake QoS's word that the caller is in its stake table
//! (`staked`: a property of the request's filter state, which no client
//! can set; QoS must run before the gate, as in every shipped config).
//! The facts are read lazily: a policy with only CIDR matchers never reads
//! a header or metadata.

use crate::request::{Cidr, MetadataScope, RequestFacts};

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
    /// Stake QoS found the caller in its stake table
    /// (`request::STAKED_PROPERTY`).
    Staked,
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
            Matcher::Staked => facts.staked(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

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
