//! The `env` hostcalls of proxy-wasm ABI 0.2.1 our filters import, and the
//! minimal WASI preview1 they need (environ, fd_write for logs, clocks,
//! random, proc_exit).
//!
//! HTTP callouts are recorded for the host's caller to answer
//! (`Host::take_callouts`). Calls we do not serve (gRPC, foreign functions)
//! answer a clear "unsupported" and log it; any other import the module
//! asks for is defined as a trap naming it, so a test fails on it.

use crate::abi::{self, Status};
use crate::shared::MetricKind;
use crate::vm::{LogLine, VmState};
use wasmtime::{Caller, Extern, FuncType, Linker, Memory, Val, ValType};

type Call<'a> = Caller<'a, VmState>;

fn memory(caller: &mut Call<'_>) -> wasmtime::Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(memory)) => Ok(memory),
        _ => wasmtime::bail!("the module exports no memory"),
    }
}

fn read(caller: &mut Call<'_>, ptr: i32, len: i32) -> wasmtime::Result<Vec<u8>> {
    let memory = memory(caller)?;
    let mut out = vec![0; len as u32 as usize];
    memory.read(&caller, ptr as u32 as usize, &mut out)?;
    Ok(out)
}

fn read_string(caller: &mut Call<'_>, ptr: i32, len: i32) -> wasmtime::Result<String> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
}

fn write(caller: &mut Call<'_>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<()> {
    let memory = memory(caller)?;
    memory.write(caller, ptr as u32 as usize, bytes)?;
    Ok(())
}

fn write_u32(caller: &mut Call<'_>, ptr: i32, value: u32) -> wasmtime::Result<()> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Copies `bytes` into memory the module allocates, and stores the pointer
/// and size where it asked.
fn give(caller: &mut Call<'_>, bytes: &[u8], ptr_out: i32, size_out: i32) -> wasmtime::Result<()> {
    let ptr = if bytes.is_empty() {
        0
    } else {
        let allocate = caller
            .get_export("proxy_on_memory_allocate")
            .and_then(Extern::into_func)
            .ok_or_else(|| wasmtime::format_err!("the module exports no proxy_on_memory_allocate"))?
            .typed::<i32, i32>(&caller)?;
        let ptr = allocate.call(&mut *caller, bytes.len() as i32)?;
        write(caller, ptr, bytes)?;
        ptr
    };
    write_u32(caller, ptr_out, ptr as u32)?;
    write_u32(caller, size_out, bytes.len() as u32)
}

fn status(s: Status) -> wasmtime::Result<i32> {
    Ok(s as i32)
}

/// The headers of `map_type` for the current stream, if it has them.
fn map(state: &mut VmState, map_type: i32) -> Option<&mut Vec<(String, String)>> {
    if map_type == abi::MAP_HTTP_CALL_RESPONSE_HEADERS {
        return state.call_response.as_mut().map(|(headers, _)| headers);
    }
    let stream = state.streams.get_mut(&state.current)?;
    match map_type {
        abi::MAP_REQUEST_HEADERS => Some(&mut stream.request_headers),
        abi::MAP_RESPONSE_HEADERS => Some(&mut stream.response_headers),
        abi::MAP_REQUEST_TRAILERS | abi::MAP_RESPONSE_TRAILERS => Some(&mut stream.trailers),
        _ => None,
    }
}

fn unsupported(caller: &mut Call<'_>, name: &str) -> wasmtime::Result<i32> {
    let vm = caller.data().name.clone();
    caller.data().log(LogLine {
        vm,
        level: "warn",
        message: format!("stakegate-host: {name} is not supported offline"),
    });
    status(Status::InternalFailure)
}

pub fn define(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    define_logging_and_time(linker)?;
    define_maps_and_buffers(linker)?;
    define_properties(linker)?;
    define_shared(linker)?;
    define_metrics(linker)?;
    define_stream_control(linker)?;
    define_wasi(linker)?;
    Ok(())
}

fn define_logging_and_time(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut c: Call<'_>, level: i32, ptr: i32, len: i32| {
            let message = read_string(&mut c, ptr, len)?;
            let vm = c.data().name.clone();
            c.data().log(LogLine {
                vm,
                level: abi::log_level_name(level),
                message,
            });
            status(Status::Ok)
        },
    )?;
    linker.func_wrap("env", "proxy_get_log_level", |mut c: Call<'_>, out: i32| {
        write_u32(&mut c, out, 0)?;
        status(Status::Ok)
    })?;
    linker.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: Call<'_>, out: i32| {
            let now = {
                let shared = c.data().shared.borrow();
                shared.epoch_ns + shared.now_ns
            };
            write(&mut c, out, &now.to_le_bytes())?;
            status(Status::Ok)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: Call<'_>, period: i32| {
            c.data_mut().tick_period_ms = period as u32;
            status(Status::Ok)
        },
    )?;
    Ok(())
}

fn define_maps_and_buffers(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Call<'_>, map_type: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            let key = read_string(&mut c, kp, kl)?.to_ascii_lowercase();
            let value = map(c.data_mut(), map_type)
                .and_then(|m| m.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()));
            match value {
                Some(value) => {
                    give(&mut c, value.as_bytes(), vp, vl)?;
                    status(Status::Ok)
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: Call<'_>, map_type: i32, dp: i32, dl: i32| {
            let pairs = map(c.data_mut(), map_type)
                .map(|m| m.clone())
                .unwrap_or_default();
            give(&mut c, &abi::serialize_map(&pairs), dp, dl)?;
            status(Status::Ok)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: Call<'_>, map_type: i32, dp: i32, dl: i32| {
            let bytes = read(&mut c, dp, dl)?;
            let Some(pairs) = abi::deserialize_map(&bytes) else {
                return status(Status::BadArgument);
            };
            match map(c.data_mut(), map_type) {
                Some(m) => {
                    *m = pairs
                        .into_iter()
                        .map(|(k, v)| (k.to_ascii_lowercase(), v))
                        .collect();
                    status(Status::Ok)
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    for (name, replace) in [
        ("proxy_replace_header_map_value", true),
        ("proxy_add_header_map_value", false),
    ] {
        linker.func_wrap(
            "env",
            name,
            move |mut c: Call<'_>, map_type: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
                let key = read_string(&mut c, kp, kl)?.to_ascii_lowercase();
                let value = read_string(&mut c, vp, vl)?;
                let Some(m) = map(c.data_mut(), map_type) else {
                    return status(Status::NotFound);
                };
                if replace {
                    m.retain(|(k, _)| *k != key);
                }
                m.push((key, value));
                status(Status::Ok)
            },
        )?;
    }
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Call<'_>, map_type: i32, kp: i32, kl: i32| {
            let key = read_string(&mut c, kp, kl)?.to_ascii_lowercase();
            let Some(m) = map(c.data_mut(), map_type) else {
                return status(Status::NotFound);
            };
            m.retain(|(k, _)| *k != key);
            status(Status::Ok)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Call<'_>, buffer: i32, start: i32, max: i32, dp: i32, dl: i32| {
            let state = c.data();
            let bytes = match buffer {
                abi::BUFFER_PLUGIN_CONFIGURATION => state.plugin_config.clone(),
                abi::BUFFER_VM_CONFIGURATION => state.vm_config.clone(),
                abi::BUFFER_REQUEST_BODY => state
                    .streams
                    .get(&state.current)
                    .map(|s| s.request_body.clone())
                    .unwrap_or_default(),
                abi::BUFFER_RESPONSE_BODY => Vec::new(),
                abi::BUFFER_HTTP_CALL_RESPONSE_BODY => state
                    .call_response
                    .as_ref()
                    .map(|(_, body)| body.clone())
                    .unwrap_or_default(),
                _ => return status(Status::NotFound),
            };
            let start = (start as u32 as usize).min(bytes.len());
            let end = start.saturating_add(max as u32 as usize).min(bytes.len());
            if start == end {
                return status(Status::NotFound);
            }
            give(&mut c, &bytes[start..end], dp, dl)?;
            status(Status::Ok)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |mut c: Call<'_>, buffer: i32, start: i32, size: i32, dp: i32, dl: i32| {
            let data = read(&mut c, dp, dl)?;
            let state = c.data_mut();
            let current = state.current;
            let Some(stream) = state.streams.get_mut(&current) else {
                return status(Status::NotFound);
            };
            if buffer != abi::BUFFER_REQUEST_BODY {
                return status(Status::BadArgument);
            }
            let body = &mut stream.request_body;
            let start = (start as u32 as usize).min(body.len());
            let end = start.saturating_add(size as u32 as usize).min(body.len());
            body.splice(start..end, data);
            status(Status::Ok)
        },
    )?;
    Ok(())
}

fn define_properties(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: Call<'_>, pp: i32, pl: i32, vp: i32, vl: i32| {
            let path = read(&mut c, pp, pl)?;
            match c.data().property(&path) {
                Some(value) => {
                    give(&mut c, &value, vp, vl)?;
                    status(Status::Ok)
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: Call<'_>, pp: i32, pl: i32, vp: i32, vl: i32| {
            let path = read(&mut c, pp, pl)?;
            let value = read(&mut c, vp, vl)?;
            c.data_mut().set_property(path, value);
            status(Status::Ok)
        },
    )?;
    Ok(())
}

fn define_shared(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Call<'_>, kp: i32, kl: i32, vp: i32, vl: i32, cas_out: i32| {
            let key = read_string(&mut c, kp, kl)?;
            let entry = c.data().shared.borrow().get(&key);
            match entry {
                Some((value, cas)) => {
                    give(&mut c, &value, vp, vl)?;
                    write_u32(&mut c, cas_out, cas)?;
                    status(Status::Ok)
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Call<'_>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| {
            let key = read_string(&mut c, kp, kl)?;
            let value = read(&mut c, vp, vl)?;
            let stored = c.data().shared.borrow_mut().set(&key, &value, cas as u32);
            status(if stored {
                Status::Ok
            } else {
                Status::CasMismatch
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut c: Call<'_>, np: i32, nl: i32, id_out: i32| {
            let name = read_string(&mut c, np, nl)?;
            let (vm, root) = (c.data().index, c.data().current);
            let id = c.data().shared.borrow_mut().register_queue(&name, vm, root);
            write_u32(&mut c, id_out, id)?;
            status(Status::Ok)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut c: Call<'_>, _vp: i32, _vl: i32, np: i32, nl: i32, id_out: i32| {
            let name = read_string(&mut c, np, nl)?;
            let id = c.data().shared.borrow().resolve_queue(&name);
            match id {
                Some(id) => {
                    write_u32(&mut c, id_out, id)?;
                    status(Status::Ok)
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_enqueue_shared_queue",
        |mut c: Call<'_>, id: i32, vp: i32, vl: i32| {
            let value = read(&mut c, vp, vl)?;
            if c.data().shared.borrow_mut().enqueue(id as u32, value) {
                status(Status::Ok)
            } else {
                status(Status::NotFound)
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_dequeue_shared_queue",
        |mut c: Call<'_>, id: i32, vp: i32, vl: i32| {
            let item = match c.data().shared.borrow_mut().queue(id as u32) {
                Some(queue) => queue.pop_front(),
                None => return status(Status::NotFound),
            };
            match item {
                Some(value) => {
                    give(&mut c, &value, vp, vl)?;
                    status(Status::Ok)
                }
                None => status(Status::Empty),
            }
        },
    )?;
    Ok(())
}

fn define_metrics(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Call<'_>, kind: i32, np: i32, nl: i32, id_out: i32| {
            let name = read_string(&mut c, np, nl)?;
            let kind = match kind {
                abi::METRIC_COUNTER => MetricKind::Counter,
                abi::METRIC_GAUGE => MetricKind::Gauge,
                abi::METRIC_HISTOGRAM => MetricKind::Histogram,
                _ => return status(Status::BadArgument),
            };
            let id = c.data().shared.borrow_mut().define_metric(kind, &name);
            write_u32(&mut c, id_out, id)?;
            status(Status::Ok)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |c: Call<'_>, id: i32, offset: i64| {
            let found = c
                .data()
                .shared
                .borrow_mut()
                .increment_metric(id as u32, offset);
            status(if found { Status::Ok } else { Status::NotFound })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_record_metric",
        |c: Call<'_>, id: i32, value: i64| {
            let found = c
                .data()
                .shared
                .borrow_mut()
                .record_metric(id as u32, value as u64);
            status(if found { Status::Ok } else { Status::NotFound })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_metric",
        |mut c: Call<'_>, id: i32, out: i32| {
            let value = c.data().shared.borrow().metric(id as u32);
            match value {
                Some(value) => {
                    write(&mut c, out, &(value as u64).to_le_bytes())?;
                    status(Status::Ok)
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    Ok(())
}

fn define_stream_control(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Call<'_>,
         code: i32,
         _dp: i32,
         _dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         _grpc: i32| {
            let body = read(&mut c, bp, bl)?;
            let headers = abi::deserialize_map(&read(&mut c, hp, hl)?).unwrap_or_default();
            let state = c.data_mut();
            let current = state.current;
            match state.streams.get_mut(&current) {
                Some(stream) => {
                    stream.local_reply = Some(crate::LocalReply {
                        status: code as u32,
                        headers,
                        body,
                        filter_state: stream.filter_state.clone(),
                    });
                    status(Status::Ok)
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_effective_context",
        |mut c: Call<'_>, id: i32| {
            let state = c.data_mut();
            let id_ = id as u32;
            if state.streams.contains_key(&id_)
                || id_ == state.root_id
                || state.retired_roots.contains(&id_)
            {
                state.current = id as u32;
                status(Status::Ok)
            } else {
                status(Status::BadArgument)
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_continue_stream",
        |mut c: Call<'_>, stream_type: i32| {
            let state = c.data_mut();
            let current = state.current;
            if let (abi::STREAM_REQUEST, Some(stream)) =
                (stream_type, state.streams.get_mut(&current))
            {
                stream.resumed = true;
            }
            status(Status::Ok)
        },
    )?;
    linker.func_wrap("env", "proxy_close_stream", |_: Call<'_>, _stream: i32| {
        status(Status::Ok)
    })?;
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Call<'_>,
         up: i32,
         ul: i32,
         _hp: i32,
         _hl: i32,
         bp: i32,
         bl: i32,
         _tp: i32,
         _tl: i32,
         _timeout: i32,
         token_out: i32| {
            let cluster = read_string(&mut c, up, ul)?;
            let body = read(&mut c, bp, bl)?;
            let vm = c.data().index;
            let token = c.data().shared.borrow_mut().call(vm, cluster, body);
            write_u32(&mut c, token_out, token)?;
            status(Status::Ok)
        },
    )?;
    linker.func_wrap("env", "proxy_done", |_: Call<'_>| status(Status::Ok))?;
    linker.func_wrap(
        "env",
        "proxy_get_status",
        |mut c: Call<'_>, code: i32, _mp: i32, _ml: i32| {
            write_u32(&mut c, code, 0)?;
            status(Status::Ok)
        },
    )?;
    // gRPC calls and foreign functions: each answers InternalFailure and
    // logs a warning, whatever its arity.
    for (name, arity) in [
        ("proxy_grpc_call", 12),
        ("proxy_grpc_stream", 9),
        ("proxy_grpc_send", 4),
        ("proxy_grpc_cancel", 1),
        ("proxy_grpc_close", 1),
        ("proxy_call_foreign_function", 6),
    ] {
        let ty = FuncType::new(
            linker.engine(),
            std::iter::repeat_n(ValType::I32, arity),
            [ValType::I32],
        );
        linker.func_new("env", name, ty, move |mut c, _args, results| {
            results[0] = Val::I32(unsupported(&mut c, name)?);
            Ok(())
        })?;
    }
    Ok(())
}

fn define_wasi(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    const WASI: &str = "wasi_snapshot_preview1";
    const ERRNO_SUCCESS: i32 = 0;
    const ERRNO_BADF: i32 = 8;
    // No environment variables and no arguments.
    for (sizes, get) in [
        ("environ_sizes_get", "environ_get"),
        ("args_sizes_get", "args_get"),
    ] {
        linker.func_wrap(WASI, sizes, |mut c: Call<'_>, count: i32, size: i32| {
            write_u32(&mut c, count, 0)?;
            write_u32(&mut c, size, 0)?;
            Ok(ERRNO_SUCCESS)
        })?;
        linker.func_wrap(WASI, get, |_: Call<'_>, _: i32, _: i32| Ok(ERRNO_SUCCESS))?;
    }
    // stdout and stderr become log lines; nothing else is writable.
    linker.func_wrap(
        WASI,
        "fd_write",
        |mut c: Call<'_>, fd: i32, iovs: i32, count: i32, written: i32| {
            if fd != 1 && fd != 2 {
                return Ok(ERRNO_BADF);
            }
            let mut text = Vec::new();
            for i in 0..count {
                let iov = read(&mut c, iovs + i * 8, 8)?;
                let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                text.extend(read(&mut c, ptr, len)?);
            }
            write_u32(&mut c, written, text.len() as u32)?;
            let vm = c.data().name.clone();
            let message = String::from_utf8_lossy(&text).trim_end().to_string();
            c.data().log(LogLine {
                vm,
                level: if fd == 2 { "stderr" } else { "stdout" },
                message,
            });
            Ok(ERRNO_SUCCESS)
        },
    )?;
    linker.func_wrap(
        WASI,
        "clock_time_get",
        |mut c: Call<'_>, _clock: i32, _precision: i64, out: i32| {
            let now = {
                let shared = c.data().shared.borrow();
                shared.epoch_ns + shared.now_ns
            };
            write(&mut c, out, &now.to_le_bytes())?;
            Ok(ERRNO_SUCCESS)
        },
    )?;
    // Deterministic "randomness": the same run gives the same bytes.
    linker.func_wrap(WASI, "random_get", |mut c: Call<'_>, ptr: i32, len: i32| {
        let mut seed = c.data().random_state;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        c.data_mut().random_state = seed;
        write(&mut c, ptr, &bytes)?;
        Ok(ERRNO_SUCCESS)
    })?;
    linker.func_wrap(
        WASI,
        "proc_exit",
        |_: Call<'_>, code: i32| -> wasmtime::Result<()> {
            wasmtime::bail!("the module called proc_exit({code})")
        },
    )?;
    Ok(())
}
