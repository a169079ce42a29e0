//! The hostcalls the filters make on a request's path, without panics.
//!
//! The proxy-wasm SDK's wrappers `panic!` on any status they do not expect,
//! and `get_map_value` unwraps a header as UTF-8: a client that sends a
//! header value with a byte above 0x7f (HTTP allows it) would take the VM
//! down for every request on its worker. These call the same imports and
//! turn every status other than `Ok` into `None` or `false`.

// The SDK declares these imports with its own `Status` enum as the return
// type; a host status outside that enum would be undefined behaviour
// there, so here they return the raw number.
#[allow(clashing_extern_declarations)]
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        data: *const u8,
        data_size: usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_register_shared_queue(name_data: *const u8, name_size: usize, token: *mut u32) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id_data: *const u8,
        vm_id_size: usize,
        name_data: *const u8,
        name_size: usize,
        token: *mut u32,
    ) -> u32;
    fn proxy_enqueue_shared_queue(token: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        token: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_close_stream(stream_type: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
}

const OK: u32 = 0;
const REQUEST_HEADERS: u32 = 0;
const RESPONSE_HEADERS: u32 = 2;
const CALL_RESPONSE_HEADERS: u32 = 6;
const STREAM_REQUEST: u32 = 0;

/// Which body a read is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyOf {
    Request = 0,
    Response = 1,
    /// The body of an HTTP callout's response.
    CallResponse = 4,
}

/// Takes ownership of bytes the host wrote into memory the module
/// allocated (through `proxy_on_memory_allocate`).
fn owned(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        return Vec::new();
    }
    // SAFETY: the host filled `size` bytes it allocated with the module's
    // allocator for exactly this length, and gave up ownership.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// A request header's value; `None` when absent, or not UTF-8.
pub fn request_header(name: &str) -> Option<String> {
    header(REQUEST_HEADERS, name)
}

/// A response header's value; `None` when absent, or not UTF-8.
pub fn response_header(name: &str) -> Option<String> {
    header(RESPONSE_HEADERS, name)
}

/// A header of the HTTP callout response being handed over.
pub fn call_response_header(name: &str) -> Option<String> {
    header(CALL_RESPONSE_HEADERS, name)
}

fn header(map: u32, name: &str) -> Option<String> {
    let (mut data, mut size) = (std::ptr::null_mut(), 0);
    // SAFETY: pointers to locals, and the key's own bytes.
    let status =
        unsafe { proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size) };
    if status != OK {
        return None;
    }
    String::from_utf8(owned(data, size)).ok()
}

/// A property by path (e.g. `["source", "address"]`); `None` when absent.
pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    // The ABI's path: the parts joined by NUL.
    let serialized = path.join("\0");
    let (mut data, mut size) = (std::ptr::null_mut(), 0);
    // SAFETY: pointers to locals and to the path's bytes.
    let status =
        unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
    if status != OK || data.is_null() {
        return None;
    }
    Some(owned(data, size))
}

/// Sets a property of the current stream (a one-part path): Envoy keeps it
/// in the stream's filter state, where the filters after this one on the
/// response's way read it with `property`. `false` if the host refused.
pub fn set_property(name: &str, value: &[u8]) -> bool {
    // SAFETY: the name's and the value's own bytes.
    unsafe { proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) == OK }
}

/// Removes a request header (nothing happens if it is absent).
pub fn remove_request_header(name: &str) {
    // SAFETY: the key's own bytes.
    unsafe {
        proxy_remove_header_map_value(REQUEST_HEADERS, name.as_ptr(), name.len());
    }
}

/// Sets a response header (replacing any value it had).
pub fn set_response_header(name: &str, value: &str) {
    // SAFETY: the key's and the value's own bytes.
    unsafe {
        proxy_replace_header_map_value(
            RESPONSE_HEADERS,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        );
    }
}

/// Removes a response header (nothing happens if it is absent).
pub fn remove_response_header(name: &str) {
    // SAFETY: the key's own bytes.
    unsafe {
        proxy_remove_header_map_value(RESPONSE_HEADERS, name.as_ptr(), name.len());
    }
}

/// The body (or upgraded stream data) Envoy is handing over, read on
/// demand.
pub struct HostBody(pub BodyOf);

impl stakegate_core::request::Body for HostBody {
    fn read(&mut self, start: usize, len: usize) -> Vec<u8> {
        body(self.0, start, len)
    }
}

/// Up to `len` bytes from `start` of the body being handed over; empty when
/// there is none.
pub fn body(of: BodyOf, start: usize, len: usize) -> Vec<u8> {
    let (mut data, mut size) = (std::ptr::null_mut(), 0);
    // SAFETY: pointers to locals.
    let status = unsafe { proxy_get_buffer_bytes(of as u32, start, len, &mut data, &mut size) };
    if status != OK {
        return Vec::new();
    }
    owned(data, size)
}

/// Replaces the whole of the body (or upgraded stream data) being handed
/// over, or held by this filter, with `bytes`. `false` if the host refused.
pub fn replace_body(of: BodyOf, bytes: &[u8]) -> bool {
    // Envoy replaces the whole buffer when the length given covers it.
    // SAFETY: the bytes' own pointer and length.
    unsafe { proxy_set_buffer_bytes(of as u32, 0, usize::MAX, bytes.as_ptr(), bytes.len()) == OK }
}

/// Registers (or finds) the shared queue `name` of this VM's `vm_id`.
pub fn register_queue(name: &str) -> Option<u32> {
    let mut token = 0;
    // SAFETY: the name's own bytes and a local.
    let status = unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut token) };
    (status == OK).then_some(token)
}

/// Finds the shared queue `name` that a VM of `vm_id` registered.
pub fn resolve_queue(vm_id: &str, name: &str) -> Option<u32> {
    let mut token = 0;
    // SAFETY: the strings' own bytes and a local.
    let status = unsafe {
        proxy_resolve_shared_queue(
            vm_id.as_ptr(),
            vm_id.len(),
            name.as_ptr(),
            name.len(),
            &mut token,
        )
    };
    (status == OK).then_some(token)
}

/// Puts `value` on a shared queue. `false` if the host refused.
pub fn enqueue(token: u32, value: &[u8]) -> bool {
    // SAFETY: the value's own bytes.
    unsafe { proxy_enqueue_shared_queue(token, value.as_ptr(), value.len()) == OK }
}

/// Takes the oldest value off a shared queue: `Ok(None)` when it is empty
/// (status `Empty`, 7), `Err(status)` when the host refused.
pub fn dequeue(token: u32) -> Result<Option<Vec<u8>>, u32> {
    const EMPTY: u32 = 7;
    let (mut data, mut size) = (std::ptr::null_mut(), 0);
    // SAFETY: pointers to locals.
    match unsafe { proxy_dequeue_shared_queue(token, &mut data, &mut size) } {
        OK => Ok(Some(owned(data, size))),
        EMPTY => Ok(None),
        status => Err(status),
    }
}

/// Makes hostcalls act on context `id` (a stream of this VM) until the
/// callback returns. `false` if the host refused (the stream is gone).
pub fn act_on(id: u32) -> bool {
    // SAFETY: plain value.
    unsafe { proxy_set_effective_context(id) == OK }
}

/// Resumes a request paused by this filter. `false` if the host refused.
pub fn resume_request() -> bool {
    // SAFETY: plain value.
    unsafe { proxy_continue_stream(STREAM_REQUEST) == OK }
}

/// Resets the current request's stream (the client sees the connection,
/// or its HTTP/2 stream, closed). `false` if the host refused.
pub fn close_request() -> bool {
    // SAFETY: plain value.
    unsafe { proxy_close_stream(STREAM_REQUEST) == OK }
}

/// Answers the current request locally. `false` if the host refused (the
/// stream is already gone: nothing is left to answer).
pub fn send_response(status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
    let headers = serialize(headers);
    // SAFETY: pointers into live buffers with their lengths.
    unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        ) == OK
    }
}

/// Answers the current request with the gate's `reply`, telling the
/// filters before it the node's time on it where the reply says it, and
/// the client the node's own word on it in header `said_in`.
pub fn send_reply(reply: &stakegate_core::gate::reply::Reply, said_in: Option<&str>) -> bool {
    if let Some(us) = reply.node_us {
        set_node_us(us);
    }
    let said = said_in
        .zip(reply.said_us)
        .map(|(n, us)| (n, us.to_string()));
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .chain(said.iter().map(|(n, us)| (*n, us.as_str())))
        .collect();
    send_response(reply.status, &headers, &reply.body)
}

/// Tells the filters before the gate the node's time on the current
/// request (`cost::NODE_US_PROPERTY`).
pub fn set_node_us(us: u64) -> bool {
    set_property(
        stakegate_core::cost::NODE_US_PROPERTY,
        us.to_string().as_bytes(),
    )
}

/// Tells the filters before the gate what the node has answered on the
/// current WebSocket so far (`cost::SOCKET_ANSWERED_PROPERTY`).
pub fn set_socket_answered(answered: &stakegate_core::cost::SocketAnswered) -> bool {
    set_property(
        stakegate_core::cost::SOCKET_ANSWERED_PROPERTY,
        answered.text().as_bytes(),
    )
}

/// What the node has answered on the current WebSocket as the gate told
/// it, if it did.
pub fn socket_answered() -> Option<stakegate_core::cost::SocketAnswered> {
    let told = property(&[stakegate_core::cost::SOCKET_ANSWERED_PROPERTY])?;
    stakegate_core::cost::SocketAnswered::read(&told)
}

/// Whether stake QoS asks that the current WebSocket's data wait, if it
/// said (`request::SOCKET_HOLD_PROPERTY`).
pub fn socket_hold() -> Option<bool> {
    let told = property(&[stakegate_core::request::SOCKET_HOLD_PROPERTY])?;
    Some(told == b"1")
}

/// The node's time on the current request as the gate told it, if it did.
pub fn node_us() -> Option<u64> {
    let told = property(&[stakegate_core::cost::NODE_US_PROPERTY])?;
    std::str::from_utf8(&told).ok()?.parse().ok()
}

/// Sends an HTTP callout to `cluster`; it belongs to the context it is
/// sent from (send it from a root context so that no stream's end cancels
/// it). Returns its token, or the host's refusal.
pub fn dispatch_call(
    cluster: &str,
    headers: &[(&str, String)],
    body: &[u8],
    timeout_ms: u64,
) -> Result<u32, proxy_wasm::types::Status> {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    proxy_wasm::hostcalls::dispatch_http_call(
        cluster,
        headers,
        Some(body),
        vec![],
        std::time::Duration::from_millis(timeout_ms),
    )
}

/// Sends the gate's `callout` (see `dispatch_call`); the error is the
/// host's refusal, as it said it.
pub fn send_callout(callout: &stakegate_core::gate::reply::Callout) -> Result<u32, String> {
    dispatch_call(
        &callout.cluster,
        &callout.headers,
        &callout.body,
        callout.timeout_ms,
    )
    .map_err(|status| format!("{status:?}"))
}

/// The proxy-wasm map encoding: the pair count, each key and value length
/// (u32 little-endian), then each key and value followed by a NUL.
fn serialize(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (name, value) in pairs {
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in pairs {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out
}
