//! The canonical form of a JSON-RPC request, for telling two requests
//! apart (dedup's key): the body read into a tree of raw tokens by a strict
//! JSON reader and written back with no whitespace, each object's members
//! sorted by their raw key bytes (a stable sort, so repeated keys keep their
//! order), and each call's top-level `id` left out.
//!
//! Scalars are copied byte for byte: `1` and `1.0`, or `"A"` and
//! `"\u0041"`, stay different. So the canonical form can only tell two
//! requests apart that a node would answer alike, never merge two it could
//! answer differently: it is the same JSON value as the input, and from it
//! the input's tree can be read back up to member order and whitespace.
//! Only a call's own `id` is left out (a retry usually takes a new id); an
//! `id` inside `params` is kept. A call is marked by whether it had an
//! `id`: a notification gets no answer, so it is never the same request as
//! a call. The reader is stricter than the scanner (`scan`): numbers and
//! escapes must be JSON's, so a token echoed back stays JSON.

use super::scan::MAX_DEPTH;

/// Why a body has no canonical form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unread {
    /// Not JSON, as a strict reader takes it.
    NotJson,
    /// Nested deeper than `MAX_DEPTH`.
    TooDeep,
}

/// A body in canonical form.
#[derive(Debug)]
pub struct Canonical<'a> {
    root: Node<'a>,
}

impl<'a> Canonical<'a> {
    /// Reads `bytes`: one JSON value, whitespace around it.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, Unread> {
        let mut parser = Parser { bytes, at: 0 };
        let root = parser.value(0)?;
        parser.space();
        if parser.at != bytes.len() {
            return Err(Unread::NotJson);
        }
        Ok(Self { root })
    }

    /// Writes the canonical text to `out`, in pieces: a request, or each
    /// entry of a batch, without its top-level `id`.
    pub fn write(&self, out: &mut impl FnMut(&[u8])) {
        match &self.root {
            Node::Array(entries) => {
                out(b"[");
                for (i, entry) in entries.iter().enumerate() {
                    if i > 0 {
                        out(b",");
                    }
                    write_request(entry, out);
                }
                out(b"]");
            }
            request => write_request(request, out),
        }
    }
}

const ID: &[u8] = b"\"id\"";

#[derive(Debug)]
enum Node<'a> {
    /// A string (with its quotes), number, `true`, `false` or `null`,
    /// exactly as written.
    Scalar(&'a [u8]),
    Array(Vec<Node<'a>>),
    /// Members with their raw keys (quotes included), sorted.
    Object(Vec<(&'a [u8], Node<'a>)>),
}

/// A request object without its top-level `id`, but marked by whether it
/// had one: a notification (no `id`) gets no answer, so it is never the
/// same request as a call.
fn write_request(node: &Node<'_>, out: &mut impl FnMut(&[u8])) {
    match node {
        Node::Object(members) => {
            let call = members.iter().any(|(k, _)| *k == ID);
            out(if call { b"c" } else { b"n" });
            write_members(members.iter().filter(|(k, _)| *k != ID), out)
        }
        other => write(other, out),
    }
}

fn write_members<'n, 'a: 'n>(
    members: impl Iterator<Item = &'n (&'a [u8], Node<'a>)>,
    out: &mut impl FnMut(&[u8]),
) {
    out(b"{");
    for (i, (key, value)) in members.enumerate() {
        if i > 0 {
            out(b",");
        }
        out(key);
        out(b":");
        write(value, out);
    }
    out(b"}");
}

fn write(node: &Node<'_>, out: &mut impl FnMut(&[u8])) {
    match node {
        Node::Scalar(raw) => out(raw),
        Node::Array(items) => {
            out(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out(b",");
                }
                write(item, out);
            }
            out(b"]");
        }
        Node::Object(members) => write_members(members.iter(), out),
    }
}

/// A strict JSON reader that keeps raw tokens.
struct Parser<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Parser<'a> {
    fn space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.at) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.bytes.get(self.at).copied()
    }

    fn expect(&mut self, byte: u8) -> Result<(), Unread> {
        if self.peek() == Some(byte) {
            self.at += 1;
            Ok(())
        } else {
            Err(Unread::NotJson)
        }
    }

    fn value(&mut self, depth: usize) -> Result<Node<'a>, Unread> {
        if depth > MAX_DEPTH {
            return Err(Unread::TooDeep);
        }
        match self.peek().ok_or(Unread::NotJson)? {
            b'{' => {
                self.at += 1;
                let mut members = Vec::new();
                if self.peek() == Some(b'}') {
                    self.at += 1;
                    return Ok(Node::Object(members));
                }
                loop {
                    self.space();
                    let key = self.string()?;
                    self.expect(b':')?;
                    members.push((key, self.value(depth + 1)?));
                    if self.peek() == Some(b',') {
                        self.at += 1;
                    } else {
                        self.expect(b'}')?;
                        break;
                    }
                }
                // Stable: members under one key keep their order.
                members.sort_by(|a, b| a.0.cmp(b.0));
                Ok(Node::Object(members))
            }
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                if self.peek() == Some(b']') {
                    self.at += 1;
                    return Ok(Node::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    if self.peek() == Some(b',') {
                        self.at += 1;
                    } else {
                        self.expect(b']')?;
                        break;
                    }
                }
                Ok(Node::Array(items))
            }
            b'"' => Ok(Node::Scalar(self.string()?)),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(Unread::NotJson),
        }
    }

    /// A string token, quotes included, escapes left as written (and
    /// checked: only JSON's escapes, so a token echoed back stays JSON).
    fn string(&mut self) -> Result<&'a [u8], Unread> {
        let start = self.at;
        if self.bytes.get(start) != Some(&b'"') {
            return Err(Unread::NotJson);
        }
        let mut i = start + 1;
        loop {
            match self.bytes.get(i) {
                None => return Err(Unread::NotJson),
                Some(b'"') => break,
                Some(b'\\') => match self.bytes.get(i + 1) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                    Some(b'u')
                        if self
                            .bytes
                            .get(i + 2..i + 6)
                            .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit)) =>
                    {
                        i += 6
                    }
                    _ => return Err(Unread::NotJson),
                },
                Some(&b) if b < 0x20 => return Err(Unread::NotJson),
                Some(_) => i += 1,
            }
        }
        self.at = i + 1;
        Ok(&self.bytes[start..self.at])
    }

    fn literal(&mut self, word: &[u8]) -> Result<Node<'a>, Unread> {
        let start = self.at;
        if self.bytes[start..].starts_with(word) {
            self.at += word.len();
            Ok(Node::Scalar(&self.bytes[start..self.at]))
        } else {
            Err(Unread::NotJson)
        }
    }

    /// `-? int frac? exp?`, as JSON has it.
    fn number(&mut self) -> Result<Node<'a>, Unread> {
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while p.bytes.get(p.at).is_some_and(u8::is_ascii_digit) {
                p.at += 1;
            }
            if p.at == from {
                Err(Unread::NotJson)
            } else {
                Ok(())
            }
        };
        if self.bytes.get(self.at) == Some(&b'-') {
            self.at += 1;
        }
        // No leading zeros: `0`, or a digit 1-9 then any digits.
        if self.bytes.get(self.at) == Some(&b'0') {
            self.at += 1;
        } else {
            digits(self)?;
        }
        if self.bytes.get(self.at) == Some(&b'.') {
            self.at += 1;
            digits(self)?;
        }
        if let Some(b'e' | b'E') = self.bytes.get(self.at) {
            self.at += 1;
            if let Some(b'+' | b'-') = self.bytes.get(self.at) {
                self.at += 1;
            }
            digits(self)?;
        }
        Ok(Node::Scalar(&self.bytes[start..self.at]))
    }
}
