//! Facts about the current request (class matchers, identities), read from
//! Envoy only when asked.

use crate::{host, property_string};
use stakegate_core::request::{parse_socket_ip, MetadataScope, RequestFacts};
use std::net::IpAddr;

pub struct StreamFacts;

impl RequestFacts for StreamFacts {
    fn metadata_class(&mut self, scope: MetadataScope) -> Option<String> {
        let root = match scope {
            MetadataScope::Listener => "listener_metadata",
            MetadataScope::Route => "route_metadata",
        };
        // Envoy serves listener and route metadata under the `xds` attributes.
        property_string(&["xds", root, "filter_metadata", "stakegate", "class"])
    }

    fn source_ip(&mut self) -> Option<IpAddr> {
        property_string(&["source", "address"]).and_then(|a| parse_socket_ip(&a))
    }

    fn peer_uri_san(&mut self) -> Option<String> {
        property_string(&["connection", "uri_san_peer_certificate"]).filter(|s| !s.is_empty())
    }

    fn peer_subject(&mut self) -> Option<String> {
        property_string(&["connection", "subject_peer_certificate"]).filter(|s| !s.is_empty())
    }

    fn header(&mut self, name: &str) -> Option<String> {
        host::request_header(name)
    }

    fn staked(&mut self) -> bool {
        crate::host::property(&[stakegate_core::request::STAKED_PROPERTY]).as_deref() == Some(b"1")
    }

    fn qos_identity(&mut self) -> Option<u64> {
        let told = crate::host::property(&[stakegate_core::request::IDENTITY_PROPERTY])?;
        u64::from_str_radix(std::str::from_utf8(&told).ok()?, 16).ok()
    }

    fn route_cluster(&mut self) -> Option<String> {
        property_string(&["xds", "cluster_name"]).filter(|s| !s.is_empty())
    }
}
