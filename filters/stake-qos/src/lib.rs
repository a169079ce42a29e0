//! stake-qos: the proxy-wasm glue for stake-weighted rate shares.
//!
//! The gate's logic lives in `stakegate-core`; this crate reads what Envoy
//! gives it and maps decisions to actions. Until the QoS policy lands it passes
//! every request through, so the module already loads and runs in Envoy.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(QosRoot) });
}}

struct QosRoot;

impl Context for QosRoot {}

impl RootContext for QosRoot {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(PassThrough))
    }
}

struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {}
