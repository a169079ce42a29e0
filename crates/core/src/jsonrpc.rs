//! What the filters read of a JSON-RPC body without parsing it.

/// How many calls a body holds: the number of entries of a top-level array
/// (a batch), else 1. Only the top level is walked (strings and nesting are
/// skipped over), so this costs one pass over the bytes and no allocation;
/// a body that is not JSON counts as one call.
pub fn calls(body: &[u8]) -> u32 {
    let mut bytes = body.iter().skip_while(|b| b.is_ascii_whitespace());
    if bytes.next() != Some(&b'[') {
        return 1;
    }
    let (mut depth, mut in_string, mut escape) = (0u32, false, false);
    let (mut count, mut any) = (0u32, false);
    for &b in bytes {
        if in_string {
            match (escape, b) {
                (true, _) => escape = false,
                (false, b'\\') => escape = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => {
                in_string = true;
                any = true;
            }
            b'{' | b'[' => {
                depth += 1;
                any = true;
            }
            b'}' | b']' if depth == 0 => break,
            b'}' | b']' => depth -= 1,
            b',' if depth == 0 => count = count.saturating_add(1),
            b if !b.is_ascii_whitespace() => any = true,
            _ => {}
        }
    }
    if any {
        count.saturating_add(1)
    } else {
        // `[]` is one (invalid) request, answered with one error.
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_count_their_entries() {
        assert_eq!(calls(br#"{"id":1,"method":"eth_call","params":[1,2]}"#), 1);
        assert_eq!(
            calls(br#" [ {"id":1,"method":"a","params":[[1,2],{"x":"],["}]}, {"id":2}, 3 ] "#),
            3
        );
        assert_eq!(calls(br#"[{"method":"a","params":["\"],["]}]"#), 1);
        assert_eq!(calls(b"[]"), 1);
        assert_eq!(calls(b"garbage"), 1);
        assert_eq!(calls(b""), 1);
        let fifty = format!("[{}]", vec![r#"{"id":1,"method":"m"}"#; 50].join(","));
        assert_eq!(calls(fifty.as_bytes()), 50);
    }
}
