//! The one reader of JSON-RPC text: a streaming scanner that checks the
//! JSON grammar byte by byte and notes what a gateway needs of each call,
//! without building values.
//!
//! It takes a message in whatever pieces it comes (an HTTP body, or a
//! WebSocket message's payload as its frames arrive), keeps a few bytes of
//! state, and gives a `Summary`: the message's shape, and for each call
//! (the object, or each entry of a batch) where its `id`, `method`,
//! `result` and `error` members are, as byte ranges of the message.
//!
//! **Which members count.** A key is compared with a name as a node would
//! compare it, whichever node that is: after its escapes are decoded
//! (`"\u0069d"` is `id`, as serde reads it), and case-insensitively (Go's
//! `encoding/json`, which geth and Erigon use, matches `"ID"` and `"Id"` to
//! `id`, with its Unicode folds: U+212A is `k`, U+017F is `s`). A member
//! whose key is written exactly as the lowercase name, with no escape, is
//! *plain*: every node reads it the same way.
//!
//! **Grammar.** Strings, escapes, brackets, commas and colons are checked;
//! numbers are any run of `-+.eE0-9` that starts like one (a node that
//! refuses `01` answers it with a parse error, which is still one answer).
//! Nesting deeper than `MAX_DEPTH` makes the text invalid.

use std::ops::Range;

/// Nesting deeper than this is not read (the text counts as invalid).
pub const MAX_DEPTH: usize = 64;
/// Method names longer than this (decoded) are not kept.
const MAX_METHOD: usize = 128;
/// Raw key bytes kept to compare with a name (an escaped seven-letter name
/// takes 42).
const MAX_KEY: usize = 64;
/// Raw bytes kept of a key or a method name (six per escaped character).
const MAX_KEPT: usize = MAX_METHOD * 6;

/// The JSON-RPC members a gateway looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Name {
    Id,
    Method,
    Result,
    Error,
}

impl Name {
    const ALL: [Name; 4] = [Name::Id, Name::Method, Name::Result, Name::Error];

    fn text(self) -> &'static str {
        match self {
            Name::Id => "id",
            Name::Method => "method",
            Name::Result => "result",
            Name::Error => "error",
        }
    }
}

/// One named member of a call object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: Name,
    /// The key is written exactly as the lowercase name, with no escape.
    pub plain: bool,
    /// The key token, quotes included.
    pub key: Range<usize>,
    pub value: Range<usize>,
}

/// One call: the message's object, or one entry of a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    /// The entry's value in the message.
    pub span: Range<usize>,
    /// It is an object (anything else is no call at all).
    pub object: bool,
    /// Its `id`, `method`, `result` and `error` members, in order.
    pub members: Vec<Member>,
    /// The last method member's value, when it is a string (decoded).
    pub method: Option<String>,
}

impl Entry {
    /// The members called `name`, in order.
    pub fn named(&self, name: Name) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(move |m| m.name == name)
    }

    /// The last member called `name` (the one JSON readers keep).
    pub fn last(&self, name: Name) -> Option<&Member> {
        self.members.iter().rev().find(|m| m.name == name)
    }

    pub fn has(&self, name: Name) -> bool {
        self.members.iter().any(|m| m.name == name)
    }
}

/// What the message is at its top level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Shape {
    /// Nothing but whitespace (or nothing read yet).
    #[default]
    Empty,
    Object,
    /// A batch (or an array that is not one).
    Array,
    /// A string, number, `true`, `false` or `null`.
    Scalar,
}

/// What a scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// One JSON value, whole, with nothing after it but whitespace.
    pub valid: bool,
    pub shape: Shape,
    /// The object's call, or the batch's entries in order (objects or
    /// not). Empty for a scalar.
    pub entries: Vec<Entry>,
}

impl Summary {
    /// Reads a whole message.
    pub fn of(message: &[u8]) -> Self {
        let mut scanner = Scanner::default();
        scanner.push(message);
        scanner.finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Expect {
    #[default]
    Value,
    /// After `[`: a value, or `]`.
    ValueOrClose,
    /// After `{`: a key, or `}`.
    KeyOrClose,
    /// After `,` in an object.
    Key,
    Colon,
    CommaOrClose,
    /// The top-level value is whole.
    End,
}

#[derive(Debug, Clone, Default)]
enum Token {
    #[default]
    None,
    /// A string: whether the last byte was a backslash, and the hex
    /// digits left of a `\u` escape.
    Text {
        escape: bool,
        hex: u8,
    },
    /// `true`, `false` or `null`, matched so far.
    Word {
        word: &'static [u8],
        matched: usize,
    },
    Number,
}

/// A string being kept: a key at a call's level, or a method's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    Key,
    Method,
}

/// The member being read at a call's level.
#[derive(Debug, Clone)]
struct Open {
    name: Option<Name>,
    plain: bool,
    key: Range<usize>,
    value_start: usize,
}

/// The streaming scanner: `push` the message's bytes in any pieces, then
/// `finish`.
#[derive(Debug, Clone, Default)]
pub struct Scanner {
    /// Offset of the next byte.
    at: usize,
    /// Open containers, innermost last: `true` for an object.
    stack: Vec<bool>,
    expect: Expect,
    token: Token,
    token_start: usize,
    invalid: bool,
    shape: Shape,
    entries: Vec<Entry>,
    /// The string being kept, raw (escapes as written), what it is, and
    /// whether it was too long to keep whole.
    kept: Vec<u8>,
    keep: Option<Keep>,
    kept_overflow: bool,
    open: Option<Open>,
}

impl Scanner {
    /// Reads the next piece of the message.
    pub fn push(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while let Some((&b, after)) = rest.split_first() {
            if self.invalid {
                return;
            }
            let run = self.plain_run(rest);
            if run > 0 {
                self.at += run;
                rest = &rest[run..];
                continue;
            }
            self.byte(b);
            self.at += 1;
            rest = after;
        }
    }

    /// How many of `bytes`' first bytes change nothing but the offset (and
    /// what a kept string keeps): a string's plain characters, a number's
    /// digits, whitespace between tokens. The bytes between a message's
    /// quotes are most of it, so they are skipped as a run, not one by one.
    fn plain_run(&mut self, bytes: &[u8]) -> usize {
        match self.token {
            Token::Text {
                escape: false,
                hex: 0,
            } => {
                let run = bytes
                    .iter()
                    .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                    .unwrap_or(bytes.len());
                if self.keep.is_some() {
                    let room = MAX_KEPT.saturating_sub(self.kept.len());
                    self.kept.extend_from_slice(&bytes[..run.min(room)]);
                    self.kept_overflow |= run > room;
                }
                run
            }
            Token::Number => bytes
                .iter()
                .position(|b| !matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                .unwrap_or(bytes.len()),
            Token::None => bytes
                .iter()
                .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
                .unwrap_or(bytes.len()),
            _ => 0,
        }
    }

    /// The summary of everything pushed.
    pub fn finish(mut self) -> Summary {
        if matches!(self.token, Token::Number) {
            self.end_scalar(self.at);
        }
        if let Token::Word { word, matched } = self.token {
            if matched == word.len() {
                self.end_scalar(self.at);
            } else {
                self.invalid = true;
            }
        }
        Summary {
            valid: !self.invalid && self.expect == Expect::End,
            shape: self.shape,
            entries: self.entries,
        }
    }

    /// The depth at which a call's members are: 1 in an object message, 2
    /// in an object entry of a batch.
    fn call_depth(&self) -> usize {
        match self.shape {
            Shape::Object => 1,
            Shape::Array => 2,
            _ => usize::MAX,
        }
    }

    /// Whether the container at `depth` (1-based) is the object of a call.
    fn in_call(&self) -> bool {
        let depth = self.stack.len();
        depth == self.call_depth() && self.stack.last() == Some(&true)
    }

    fn byte(&mut self, b: u8) {
        match self.token {
            Token::Text { escape, hex } => return self.text(b, escape, hex),
            Token::Word { word, matched } => {
                if matched < word.len() {
                    if word[matched] == b {
                        self.token = Token::Word {
                            word,
                            matched: matched + 1,
                        };
                    } else {
                        self.invalid = true;
                    }
                    return;
                }
                self.end_scalar(self.at);
            }
            Token::Number => {
                if matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') {
                    return;
                }
                self.end_scalar(self.at);
            }
            Token::None => {}
        }
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            return;
        }
        match self.expect {
            Expect::Value | Expect::ValueOrClose => {
                if b == b']' && self.expect == Expect::ValueOrClose {
                    self.close(b);
                } else {
                    self.value(b);
                }
            }
            Expect::KeyOrClose | Expect::Key => {
                if b == b'"' {
                    self.start_key();
                } else if b == b'}' && self.expect == Expect::KeyOrClose {
                    self.close(b);
                } else {
                    self.invalid = true;
                }
            }
            Expect::Colon => {
                if b == b':' {
                    self.expect = Expect::Value;
                } else {
                    self.invalid = true;
                }
            }
            Expect::CommaOrClose => match b {
                b',' => {
                    self.expect = if self.stack.last() == Some(&true) {
                        Expect::Key
                    } else {
                        Expect::Value
                    };
                }
                b'}' | b']' => self.close(b),
                _ => self.invalid = true,
            },
            Expect::End => self.invalid = true,
        }
    }

    /// The first byte of a value.
    fn value(&mut self, b: u8) {
        self.begin_value();
        match b {
            b'{' | b'[' => {
                if self.stack.len() >= MAX_DEPTH {
                    self.invalid = true;
                    return;
                }
                let object = b == b'{';
                if self.stack.is_empty() {
                    self.shape = if object { Shape::Object } else { Shape::Array };
                    if object {
                        self.entries.push(Entry {
                            span: self.at..self.at,
                            object: true,
                            ..Entry::default()
                        });
                    }
                } else if self.stack.len() == 1 && self.shape == Shape::Array {
                    if let Some(entry) = self.entries.last_mut() {
                        entry.object = object;
                    }
                }
                self.stack.push(object);
                self.expect = if object {
                    Expect::KeyOrClose
                } else {
                    Expect::ValueOrClose
                };
            }
            b'"' => {
                self.token = Token::Text {
                    escape: false,
                    hex: 0,
                };
                self.token_start = self.at;
                let method = self.open.as_ref().is_some_and(|o| {
                    o.name == Some(Name::Method) && self.stack.len() == self.call_depth()
                });
                if method {
                    self.keep = Some(Keep::Method);
                    self.kept.clear();
                    self.kept_overflow = false;
                }
            }
            b't' | b'f' | b'n' => {
                let word: &'static [u8] = match b {
                    b't' => b"true",
                    b'f' => b"false",
                    _ => b"null",
                };
                self.token = Token::Word { word, matched: 1 };
            }
            b'-' | b'0'..=b'9' => self.token = Token::Number,
            _ => self.invalid = true,
        }
        if self.stack.is_empty() && matches!(self.token, Token::Word { .. } | Token::Number) {
            self.shape = Shape::Scalar;
        }
        if self.stack.is_empty() && matches!(self.token, Token::Text { .. }) {
            self.shape = Shape::Scalar;
        }
    }

    /// A value begins at `self.at`: a batch entry's, or a call member's.
    fn begin_value(&mut self) {
        if self.stack.len() == 1 && self.shape == Shape::Array {
            self.entries.push(Entry {
                span: self.at..self.at,
                ..Entry::default()
            });
        }
        let at_call = self.stack.len() == self.call_depth();
        if let (Some(open), true) = (&mut self.open, at_call) {
            open.value_start = self.at;
        }
    }

    fn start_key(&mut self) {
        self.token = Token::Text {
            escape: false,
            hex: 0,
        };
        self.token_start = self.at;
        if self.in_call() {
            self.keep = Some(Keep::Key);
            self.kept.clear();
            self.kept_overflow = false;
        }
    }

    fn text(&mut self, b: u8, escape: bool, hex: u8) {
        let keep = |s: &mut Self| {
            if s.keep.is_some() {
                if s.kept.len() < MAX_KEPT {
                    s.kept.push(b);
                } else {
                    s.kept_overflow = true;
                }
            }
        };
        if hex > 0 {
            if !b.is_ascii_hexdigit() {
                self.invalid = true;
                return;
            }
            keep(self);
            self.token = Token::Text {
                escape: false,
                hex: hex - 1,
            };
            return;
        }
        if escape {
            let hex = match b {
                b'u' => 4,
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 0,
                _ => {
                    self.invalid = true;
                    return;
                }
            };
            keep(self);
            self.token = Token::Text { escape: false, hex };
            return;
        }
        match b {
            b'"' => self.end_text(),
            b'\\' => {
                keep(self);
                self.token = Token::Text {
                    escape: true,
                    hex: 0,
                };
            }
            0..=0x1f => self.invalid = true,
            _ => keep(self),
        }
    }

    fn end_text(&mut self) {
        self.token = Token::None;
        let end = self.at + 1;
        match self.keep.take() {
            Some(Keep::Key) => {
                let raw = std::mem::take(&mut self.kept);
                let name = (!self.kept_overflow)
                    .then(|| Name::ALL.into_iter().find(|n| key_is(&raw, n.text())))
                    .flatten();
                if name == Some(Name::Method) {
                    // Only a string value names the method.
                    if let Some(entry) = self.entries.last_mut() {
                        entry.method = None;
                    }
                }
                self.open = Some(Open {
                    name,
                    plain: name.is_some_and(|n| raw == n.text().as_bytes()),
                    key: self.token_start..end,
                    value_start: end,
                });
                self.expect = Expect::Colon;
                return;
            }
            Some(Keep::Method) => {
                let raw = std::mem::take(&mut self.kept);
                let method = (!self.kept_overflow)
                    .then(|| decode_string(raw))
                    .flatten()
                    .filter(|m| m.len() <= MAX_METHOD);
                if let Some(entry) = self.entries.last_mut() {
                    entry.method = method;
                }
            }
            None => {}
        }
        if matches!(self.expect, Expect::KeyOrClose | Expect::Key) {
            // A key outside any call.
            self.expect = Expect::Colon;
            return;
        }
        self.value_done(end);
    }

    fn end_scalar(&mut self, end: usize) {
        self.token = Token::None;
        self.value_done(end);
    }

    fn close(&mut self, b: u8) {
        let object = b == b'}';
        if self.stack.pop() != Some(object) {
            self.invalid = true;
            return;
        }
        self.value_done(self.at + 1);
    }

    /// A value ended just before `end`, at the current depth.
    fn value_done(&mut self, end: usize) {
        let depth = self.stack.len();
        if depth == self.call_depth() && self.stack.last() == Some(&true) {
            if let Some(open) = self.open.take() {
                if let (Some(name), Some(entry)) = (open.name, self.entries.last_mut()) {
                    entry.members.push(Member {
                        name,
                        plain: open.plain,
                        key: open.key,
                        value: open.value_start..end,
                    });
                }
            }
        }
        if (depth == 1 && self.shape == Shape::Array) || (depth == 0 && self.shape == Shape::Object)
        {
            if let Some(entry) = self.entries.last_mut() {
                entry.span.end = end;
            }
        }
        self.expect = if depth == 0 {
            Expect::End
        } else {
            Expect::CommaOrClose
        };
    }
}

/// Whether a key token's contents (`raw`, escapes as written) name `name`
/// as some node reads it: decoded, then compared with Go's case folding.
fn key_is(raw: &[u8], name: &str) -> bool {
    if raw.len() > MAX_KEY {
        return false;
    }
    if raw.is_ascii() && !raw.contains(&b'\\') {
        return raw.eq_ignore_ascii_case(name.as_bytes());
    }
    let Some(chars) = decode(raw) else {
        return false;
    };
    chars.len() == name.len() && chars.iter().zip(name.chars()).all(|(&c, n)| fold(c) == n)
}

/// Go's `EqualFold` for a lowercase ASCII name: ASCII case, and the two
/// characters outside ASCII that fold to ASCII letters.
fn fold(c: char) -> char {
    match c {
        '\u{212A}' => 'k',
        '\u{017F}' => 's',
        c => c.to_ascii_lowercase(),
    }
}

/// A string token's contents (escapes as written) decoded; `None` as
/// `decode`.
fn decode_string(raw: Vec<u8>) -> Option<String> {
    if raw.contains(&b'\\') {
        return decode(&raw).map(String::from_iter);
    }
    String::from_utf8(raw).ok()
}

/// A string token's contents (escapes as written) decoded to characters;
/// `None` when it is not valid UTF-8 or holds an unpaired surrogate.
fn decode(raw: &[u8]) -> Option<Vec<char>> {
    let text = std::str::from_utf8(raw).ok()?;
    let mut out = Vec::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let c = match chars.next()? {
            'u' => {
                let unit = hex4(&mut chars)?;
                if (0xD800..0xDC00).contains(&unit) {
                    if chars.next()? != '\\' || chars.next()? != 'u' {
                        return None;
                    }
                    let low = hex4(&mut chars)?;
                    if !(0xDC00..0xE000).contains(&low) {
                        return None;
                    }
                    char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))?
                } else {
                    char::from_u32(unit)?
                }
            }
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            other => other,
        };
        out.push(c);
    }
    Some(out)
}

fn hex4(chars: &mut std::str::Chars<'_>) -> Option<u32> {
    let mut unit = 0;
    for _ in 0..4 {
        unit = unit * 16 + chars.next()?.to_digit(16)?;
    }
    Some(unit)
}
