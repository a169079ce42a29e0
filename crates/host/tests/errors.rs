//! What the host says when a module is not what it should be.

use stakegate_host::Host;

fn error(module: &[u8]) -> String {
    format!(
        "{:#}",
        Host::new(module, b"{}", 1)
            .err()
            .expect("the host refuses it")
    )
}

/// The exports a proxy-wasm module needs, around `body` for vm_start and
/// configure.
fn proxy_wasm(imports: &str, configure: &str) -> Vec<u8> {
    let text = include_str!("../../../tests/fixtures/proxy-wasm.wat")
        .replace("{imports}", imports)
        .replace("{configure}", configure);
    wat::parse_str(text).unwrap()
}

#[test]
fn bytes_that_are_not_wasm_are_named_as_such() {
    assert_eq!(
        error(b"#!/bin/sh\necho hi\n"),
        r##"not a WebAssembly module: it does not start with the \0asm magic (it starts with "#!/bin/s")"##
    );
}

#[test]
fn a_wasm_module_without_the_proxy_wasm_abi_is_refused() {
    let module = wat::parse_str(r#"(module (func (export "add") (param i32 i32) (result i32) local.get 0 local.get 1 i32.add))"#).unwrap();
    assert_eq!(
        error(&module),
        "not a proxy-wasm module: it exports none of proxy_abi_version_0_2_1, proxy_abi_version_0_2_0 (it exports: add)"
    );
}

#[test]
fn an_unimplemented_hostcall_fails_and_is_named() {
    let module = proxy_wasm(
        r#"(import "env" "proxy_open_the_pod_bay_doors" (func $doors (result i32)))"#,
        "call $doors",
    );
    let err = error(&module);
    assert!(err.contains("proxy_on_configure failed"), "{err}");
    assert!(
        err.contains("proxy_open_the_pod_bay_doors"),
        "the hostcall is named: {err}"
    );
}

#[test]
fn a_trap_carries_the_modules_last_words() {
    let module = proxy_wasm(
        r#"(import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))"#,
        "i32.const 5 i32.const 100 i32.const 25 call $log drop unreachable",
    );
    let err = error(&module);
    assert!(err.contains("proxy_on_configure failed"), "{err}");
    assert!(err.contains("unreachable"), "the trap is named: {err}");
    assert!(
        err.contains("the module said: boom: the policy exploded"),
        "{err}"
    );
}

#[test]
fn grpc_calls_answer_unsupported() {
    let module = proxy_wasm(
        r#"(import "env" "proxy_grpc_call" (func $call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))"#,
        // Configure succeeds only if the call returned InternalFailure (10).
        "i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 i32.const 0 call $call i32.const 10 i32.eq",
    );
    let host = Host::new(&module, b"{}", 1).unwrap();
    assert!(host
        .logs()
        .iter()
        .any(|l| l.message == "stakegate-host: proxy_grpc_call is not supported offline"));
}
