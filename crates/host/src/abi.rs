//! The proxy-wasm ABI 0.2.1 values the host speaks: statuses, map and
//! buffer kinds, and the map serialization.

/// `WasmResult` in the ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
}

pub const MAP_REQUEST_HEADERS: i32 = 0;
pub const MAP_REQUEST_TRAILERS: i32 = 1;
pub const MAP_RESPONSE_HEADERS: i32 = 2;
pub const MAP_RESPONSE_TRAILERS: i32 = 3;
pub const MAP_HTTP_CALL_RESPONSE_HEADERS: i32 = 6;

pub const BUFFER_REQUEST_BODY: i32 = 0;
pub const BUFFER_RESPONSE_BODY: i32 = 1;
pub const BUFFER_HTTP_CALL_RESPONSE_BODY: i32 = 4;
pub const BUFFER_VM_CONFIGURATION: i32 = 6;
pub const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;

pub const ACTION_CONTINUE: i32 = 0;
pub const STREAM_REQUEST: i32 = 0;

pub const METRIC_COUNTER: i32 = 0;
pub const METRIC_GAUGE: i32 = 1;
pub const METRIC_HISTOGRAM: i32 = 2;

/// The ABI version exports a module may carry.
pub const ABI_VERSIONS: &[&str] = &["proxy_abi_version_0_2_1", "proxy_abi_version_0_2_0"];

pub fn log_level_name(level: i32) -> &'static str {
    match level {
        0 => "trace",
        1 => "debug",
        2 => "info",
        3 => "warn",
        4 => "error",
        _ => "critical",
    }
}

/// Header pairs as the ABI serializes them: a u32 count, then u32 key and
/// value sizes per pair, then each key and value followed by a NUL.
pub fn serialize_map(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

pub fn deserialize_map(bytes: &[u8]) -> Option<Vec<(String, String)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let u32_at = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    let count = u32_at(0)?;
    let mut sizes = Vec::with_capacity(count);
    for i in 0..count {
        sizes.push((u32_at(4 + i * 8)?, u32_at(8 + i * 8)?));
    }
    let mut at = 4 + count * 8;
    let mut pairs = Vec::with_capacity(count);
    for (ks, vs) in sizes {
        let key = String::from_utf8(bytes.get(at..at + ks)?.to_vec()).ok()?;
        at += ks + 1;
        let value = String::from_utf8(bytes.get(at..at + vs)?.to_vec()).ok()?;
        at += vs + 1;
        pairs.push((key, value));
    }
    Some(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_round_trip() {
        let pairs = vec![
            (":status".to_string(), "503".to_string()),
            ("retry-after".into(), "2".into()),
        ];
        assert_eq!(deserialize_map(&serialize_map(&pairs)).unwrap(), pairs);
        assert_eq!(deserialize_map(&[]).unwrap(), vec![]);
        assert_eq!(deserialize_map(&[5, 0, 0, 0]), None, "truncated");
    }
}
