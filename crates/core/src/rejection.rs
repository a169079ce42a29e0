//! The one shape every stakegate rejection has: a JSON-RPC 2.0 error body
//! with code -32005, the request `id` when known, otherwise `null`.

/// JSON-RPC error code for "limit exceeded", shared by both gates
/// (docs/background.md part 5, follow-ups).
pub const LIMIT_EXCEEDED: i32 = -32005;

/// JSON-RPC error code for a request that is not a valid request.
pub const INVALID_REQUEST: i32 = -32600;

/// Renders `{"jsonrpc":"2.0","id":<id>,"error":{"code":<code>,"message":<message>}}`.
///
/// `id` is the request's id as raw JSON (`7`, `"abc"`), or `None` when it is
/// not known (the gate decides before reading the body).
pub fn json_rpc_error_body(id: Option<&str>, code: i32, message: &str) -> String {
    let mut body = String::with_capacity(64 + message.len());
    body.push_str(r#"{"jsonrpc":"2.0","id":"#);
    body.push_str(id.unwrap_or("null"));
    body.push_str(r#","error":{"code":"#);
    body.push_str(&code.to_string());
    body.push_str(r#","message":""#);
    push_json_escaped(&mut body, message);
    body.push_str("\"}}");
    body
}

fn push_json_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_id_renders_null() {
        assert_eq!(
            json_rpc_error_body(None, LIMIT_EXCEEDED, "over the limit"),
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32005,"message":"over the limit"}}"#
        );
    }

    #[test]
    fn known_id_and_awkward_message_are_kept_valid_json() {
        assert_eq!(
            json_rpc_error_body(Some(r#""a-1""#), LIMIT_EXCEEDED, "say \"no\"\n\u{1}"),
            r#"{"jsonrpc":"2.0","id":"a-1","error":{"code":-32005,"message":"say \"no\"\n\u0001"}}"#
        );
    }
}
