//! What every stakegate filter needs from the proxy-wasm host, behind the
//! plain interfaces `stakegate-core` defines: shared data as a
//! `SharedStore`, the clock in milliseconds, properties, and logging.

pub mod facts;
pub mod host;
pub mod metrics;
pub mod queues;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{LogLevel, Status};
use stakegate_core::qos::report::ReportQueue;
use stakegate_core::rejection::Rejection;
use stakegate_core::shared::{SharedStore, StoreError, Write};

/// Declares which stakegate filter a module is, in a custom section named
/// `stakegate.filter` that `stakegate deploy` reads: deploying a module as
/// the wrong filter (the QoS module into the gate's slot) is refused.
#[macro_export]
macro_rules! declare_filter {
    ($name:literal) => {
        #[link_section = "stakegate.filter"]
        #[used]
        static STAKEGATE_FILTER: [u8; $name.len()] = {
            let bytes = $name.as_bytes();
            let mut out = [0u8; $name.len()];
            let mut i = 0;
            while i < bytes.len() {
                out[i] = bytes[i];
                i += 1;
            }
            out
        };
    };
}

/// Envoy's shared data for this plugin's `vm_id`.
pub struct EnvoyStore;

impl SharedStore for EnvoyStore {
    fn load(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        hostcalls::get_shared_data(key)
            .map_err(|status| StoreError::Host(format!("get_shared_data: {status:?}")))
    }

    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<Write, StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(Write::Stored),
            Err(Status::CasMismatch) => Ok(Write::CasMismatch),
            Err(status) => Err(StoreError::Host(format!("set_shared_data: {status:?}"))),
        }
    }
}

/// A proxy-wasm shared queue, as stake QoS reports travel on it.
pub struct EnvoyQueue(pub u32);

impl EnvoyQueue {
    /// Registers the queue `name` (every VM of the `vm_id` gets the same one).
    pub fn register(name: &str) -> Result<Self, String> {
        host::register_queue(name)
            .map(Self)
            .ok_or_else(|| format!("registering the shared queue {name} failed"))
    }
}

impl ReportQueue for EnvoyQueue {
    fn push(&self, report: &[u8]) -> Result<(), StoreError> {
        if host::enqueue(self.0, report) {
            Ok(())
        } else {
            Err(StoreError::Host("enqueue_shared_queue refused".into()))
        }
    }

    fn pop(&self) -> Result<Option<Vec<u8>>, StoreError> {
        host::dequeue(self.0)
            .map_err(|status| StoreError::Host(format!("dequeue_shared_queue: status {status}")))
    }
}

/// Milliseconds since the Unix epoch, from the host's clock.
pub fn now_ms() -> u64 {
    now_us() / 1000
}

/// Microseconds since the Unix epoch, from the host's clock.
pub fn now_us() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_micros() as u64)
}

/// A property as a UTF-8 string, e.g. `["source", "address"]`.
pub fn property_string(path: &[&str]) -> Option<String> {
    host::property(path).and_then(|bytes| String::from_utf8(bytes).ok())
}

/// Answers the request locally with `rejection`: its status, a JSON
/// content type, `retry-after` in whole seconds (left out when 0: the
/// request is wrong, not early), its own headers, and its JSON-RPC error
/// body.
pub fn reject(rejection: &Rejection) {
    let retry_after = rejection.retry_after_s.to_string();
    let mut headers = vec![("content-type", "application/json")];
    if rejection.retry_after_s > 0 {
        headers.push(("retry-after", retry_after.as_str()));
    }
    headers.extend(rejection.headers.iter().map(|(n, v)| (*n, v.as_str())));
    // Fails only if the stream is already gone: nothing left to answer.
    host::send_response(rejection.status, &headers, rejection.body.as_bytes());
}

/// Logs with the filter's name in front, so Envoy's log says who spoke.
pub fn log(filter: &str, level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, &format!("stakegate {filter}: {message}"));
}

/// The end of `on_configure`: `Ok` accepts the configuration; an error is
/// logged with the filter's name and refuses it, so Envoy keeps serving the
/// previous one.
pub fn accept(filter: &str, configured: Result<(), String>) -> bool {
    match configured {
        Ok(()) => true,
        Err(message) => {
            log(filter, LogLevel::Error, &message);
            false
        }
    }
}
