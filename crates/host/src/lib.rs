//! stakegate-host: an offline proxy-wasm host on wasmtime.
//!
//! It will load the *compiled* filter modules, run several worker VMs over one
//! shared-data store on a virtual clock, and back `stakegate check` and
//! `stakegate sim`. See the issue "Offline proxy-wasm host on wasmtime".
