//! Compare-and-swap updates of records in proxy-wasm shared data: the
//! gate's shard table, dedup's pages, and the QoS filter's state and
//! identity pages.
//!
//! Every change is: read the value and its CAS token, apply a pure change
//! to the decoded table, write back with the token. If another worker wrote
//! in between, the write fails with a CAS mismatch and the whole step is
//! retried on the fresh value, so a decision is always made on the count it
//! is written against.
//!
//! **Contention cost.** Each attempt is one `get_shared_data` and one
//! `set_shared_data` of the record under Envoy's shared-data lock (for the
//! gate, 15 + 24·W bytes with W worker VMs). A retry happens only when
//! another worker wrote in the window between the two calls, so retries grow
//! with W and with the request rate; the filters count them
//! (`stakegate.gate.cas_retries`, `stakegate.qos.cas_retries`).
//!
//! **When CAS keeps failing** (more than `MAX_ATTEMPTS` in a row), the step
//! gives up with `StoreError::Contended` and the caller decides: the gate
//! refuses the admission (fail closed, so the limit stays exact) and keeps
//! a finished request's slot as a local spare, handed back by a later
//! heartbeat; stake QoS admits a request whose lease it cannot take (fail
//! open: the gate still guards the node). Each filter counts retries and
//! errors in a `StoreCounts` (`cas_retries`, `store_errors`), which also
//! words each error's log line with what failed.

use std::fmt;

/// A value kept under one shared-data key. An absent key decodes as
/// `Record::default()`.
pub trait Record: Default {
    /// Decodes the stored bytes; the error says what is wrong with them.
    fn decode(bytes: &[u8]) -> Result<Self, String>;
    fn encode(&self) -> Vec<u8>;

    /// `decode`, from bytes the caller gives up (a record that is its
    /// bytes keeps them rather than copying).
    fn decode_owned(bytes: Vec<u8>) -> Result<Self, String> {
        Self::decode(&bytes)
    }

    /// `encode`, borrowed where the record is its bytes.
    fn encoded(&self) -> std::borrow::Cow<'_, [u8]> {
        self.encode().into()
    }
}

/// Attempts before an update gives up.
pub const MAX_ATTEMPTS: u32 = 32;

/// What a shared-data store answers to a conditional write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    Stored,
    CasMismatch,
}

/// The two proxy-wasm shared-data calls, so the protocol can be tested
/// without a host.
pub trait SharedStore {
    /// The value and its CAS token; `(None, None)` when the key is absent.
    fn load(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    /// Writes if the token still matches. `cas: None` writes unconditionally.
    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<Write, StoreError>;
}

/// Several holders of one store (tests: VMs over one shared data).
impl<S: SharedStore> SharedStore for &S {
    fn load(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        (**self).load(key)
    }

    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<Write, StoreError> {
        (**self).store(key, value, cas)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The host refused a call (a status other than CAS mismatch).
    Host(String),
    /// The stored bytes are not what this module reads.
    Layout(String),
    /// `MAX_ATTEMPTS` CAS mismatches in a row.
    Contended,
}

/// What a filter reports of its shared-data use, the same way in each:
/// CAS retries, and store errors, each counted and logged with what failed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StoreCounts {
    pub cas_retries: u64,
    pub store_errors: u64,
}

impl StoreCounts {
    pub fn retried(&mut self, n: u32) {
        self.cas_retries += u64::from(n);
    }

    /// Counts a store error and gives the line for Envoy's log: what
    /// failed, and why.
    #[must_use = "the line belongs in Envoy's log"]
    pub fn failed(&mut self, what: &str, e: &StoreError) -> String {
        self.store_errors += 1;
        format!("{what}: {e}")
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Host(status) => write!(f, "shared data call failed: {status}"),
            StoreError::Layout(e) => f.write_str(e),
            StoreError::Contended => {
                write!(f, "shared data CAS failed {MAX_ATTEMPTS} times in a row")
            }
        }
    }
}

/// Whether a change needs writing.
pub enum Change<T> {
    /// Write the changed table and return `T` once stored.
    Write(T),
    /// Nothing changed; return `T` without writing.
    Keep(T),
}

/// The result of an update, with the record as stored (or as read, for a
/// `Keep`) and the CAS retries it took.
#[derive(Debug)]
pub struct Updated<T, R> {
    pub value: T,
    pub table: R,
    pub retries: u32,
}

/// The record under `key` and its CAS token.
pub fn read<R: Record>(
    store: &impl SharedStore,
    key: &str,
) -> Result<(R, Option<u32>), StoreError> {
    let (bytes, cas) = store.load(key)?;
    let record = R::decode_owned(bytes.unwrap_or_default()).map_err(StoreError::Layout)?;
    Ok((record, cas))
}

/// Applies `change` to the record under `key` by compare-and-swap.
///
/// `change` may run several times, each time on a freshly read record, so
/// what it decides must come from that record (and from values that do not
/// change between attempts). An absent key is written unconditionally: for the gate that can
/// only happen before any VM has joined (see `ShardTable::join`), when no
/// slot exists to be lost; a QoS page starts empty.
pub fn update<T, R: Record>(
    store: &impl SharedStore,
    key: &str,
    change: impl FnMut(&mut R) -> Change<T>,
) -> Result<Updated<T, R>, (StoreError, u32)> {
    update_from(store, key, None, change)
}

/// `update`, whose first attempt starts from `read`, a record and token
/// the caller already read under `key` (later attempts read afresh).
pub fn update_from<T, R: Record>(
    store: &impl SharedStore,
    key: &str,
    mut read_before: Option<(R, Option<u32>)>,
    mut change: impl FnMut(&mut R) -> Change<T>,
) -> Result<Updated<T, R>, (StoreError, u32)> {
    for attempt in 0..MAX_ATTEMPTS {
        let (mut table, cas) = match read_before.take() {
            Some(before) => before,
            None => read::<R>(store, key).map_err(|e| (e, attempt))?,
        };
        let value = match change(&mut table) {
            Change::Keep(value) => {
                return Ok(Updated {
                    value,
                    table,
                    retries: attempt,
                })
            }
            Change::Write(value) => value,
        };
        match store
            .store(key, &table.encoded(), cas)
            .map_err(|e| (e, attempt))?
        {
            Write::Stored => {
                return Ok(Updated {
                    value,
                    table,
                    retries: attempt,
                })
            }
            Write::CasMismatch => continue,
        }
    }
    Err((StoreError::Contended, MAX_ATTEMPTS))
}

/// The layout every page of entries shares: version `u8`, entry count
/// `u16`, then `entry_len`-byte entries.
pub struct PageLayout {
    /// Named in errors, e.g. "QoS".
    pub what: &'static str,
    pub version: u8,
    pub entry_len: usize,
    pub max_entries: usize,
}

impl PageLayout {
    pub const HEADER_LEN: usize = 3;

    /// The entries' bytes, one chunk each, after checking the version and
    /// the length. Empty bytes (an absent key) are an empty page.
    pub fn entries<'a>(&self, bytes: &'a [u8]) -> Result<std::slice::ChunksExact<'a, u8>, String> {
        let what = self.what;
        if bytes.is_empty() {
            return Ok([].chunks_exact(self.entry_len));
        }
        if bytes[0] != self.version {
            return Err(format!(
                "shared {what} page has layout version {}, this module reads {}",
                bytes[0], self.version
            ));
        }
        let count = bytes.get(1..Self::HEADER_LEN).map_or(usize::MAX, |b| {
            usize::from(u16::from_le_bytes([b[0], b[1]]))
        });
        let expected = Self::HEADER_LEN.saturating_add(count.saturating_mul(self.entry_len));
        if count > self.max_entries || bytes.len() != expected {
            return Err(format!(
                "shared {what} page is {} bytes, expected {expected} for {count} entries",
                bytes.len()
            ));
        }
        Ok(bytes[Self::HEADER_LEN..].chunks_exact(self.entry_len))
    }

    /// The header for `count` entries.
    pub fn header(&self, count: usize) -> [u8; Self::HEADER_LEN] {
        let count = (count as u16).to_le_bytes();
        [self.version, count[0], count[1]]
    }
}

/// Reads little-endian fixed-width fields off a slice whose length the
/// decoder checked (past the end it reads zeros).
pub struct Reader<'a>(pub &'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        if let Some((head, rest)) = self.0.split_first_chunk::<N>() {
            self.0 = rest;
            return *head;
        }
        let mut out = [0; N];
        out[..self.0.len()].copy_from_slice(self.0);
        self.0 = &[];
        out
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    pub fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    pub fn f64(&mut self) -> f64 {
        f64::from_bits(self.u64())
    }
}

/// An in-memory store with Envoy's CAS semantics, for tests and the
/// simulator: every successful write bumps the token.
#[derive(Debug, Default)]
pub struct MemoryStore {
    entries: std::cell::RefCell<std::collections::HashMap<String, (Vec<u8>, u32)>>,
}

impl SharedStore for MemoryStore {
    fn load(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        Ok(match self.entries.borrow().get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<Write, StoreError> {
        let mut entries = self.entries.borrow_mut();
        let current = entries.get(key).map(|(_, c)| *c);
        if let (Some(expected), Some(current)) = (cas, current) {
            if expected != current {
                return Ok(Write::CasMismatch);
            }
        }
        let next = current.unwrap_or(0).wrapping_add(1).max(1);
        entries.insert(key.to_string(), (value.to_vec(), next));
        Ok(Write::Stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::shards::{Limits, ShardTable, SlotKind};
    use std::cell::Cell;

    const KEY: &str = "k";
    const LIMITS: Limits = Limits {
        max_inflight: Some(2),
        reserved: 0,
        cheap: 0,
        max_websocket: None,
        per_websocket: 1,
    };

    /// A store where another writer sneaks in before the first `interleave`
    /// writes.
    struct Racing<'a> {
        inner: &'a MemoryStore,
        interleave: Cell<u32>,
        rival_vm: u32,
    }

    impl SharedStore for Racing<'_> {
        fn load(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            self.inner.load(key)
        }

        fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<Write, StoreError> {
            if self.interleave.get() > 0 {
                self.interleave.set(self.interleave.get() - 1);
                let rival = self.rival_vm;
                update(self.inner, key, |t: &mut ShardTable| {
                    Change::Write(t.try_admit(rival, 0, SlotKind::Default, &LIMITS))
                })
                .map_err(|(e, _)| e)?;
            }
            self.inner.store(key, value, cas)
        }
    }

    fn joined(store: &MemoryStore) -> (u32, u32) {
        let a = update(store, KEY, |t: &mut ShardTable| Change::Write(t.join(0)))
            .unwrap()
            .value;
        let b = update(store, KEY, |t: &mut ShardTable| Change::Write(t.join(0)))
            .unwrap()
            .value;
        (a, b)
    }

    #[test]
    fn a_lost_race_is_retried_on_the_fresh_count() {
        let memory = MemoryStore::default();
        let (a, b) = joined(&memory);
        let racing = Racing {
            inner: &memory,
            interleave: Cell::new(1),
            rival_vm: b,
        };
        // The rival takes one of the 2 slots mid-flight; our admission is
        // re-decided against it and still fits.
        let updated = update(&racing, KEY, |t: &mut ShardTable| {
            Change::Write(t.try_admit(a, 0, SlotKind::Default, &LIMITS))
        })
        .unwrap();
        assert!(updated.value);
        assert_eq!(updated.retries, 1);
        assert_eq!(updated.table.totals().default, 2);
    }

    #[test]
    fn racing_admissions_never_pass_the_limit() {
        let memory = MemoryStore::default();
        let (a, b) = joined(&memory);
        // The rival fills both slots while we try; we must be refused.
        let racing = Racing {
            inner: &memory,
            interleave: Cell::new(2),
            rival_vm: b,
        };
        let updated = update(&racing, KEY, |t: &mut ShardTable| {
            if t.try_admit(a, 0, SlotKind::Default, &LIMITS) {
                Change::Write(true)
            } else {
                Change::Keep(false)
            }
        })
        .unwrap();
        assert!(!updated.value);
        assert_eq!(updated.retries, 2);
        let (bytes, _) = memory.load(KEY).unwrap();
        assert_eq!(
            ShardTable::decode(&bytes.unwrap())
                .unwrap()
                .totals()
                .default,
            2
        );
    }

    #[test]
    fn endless_contention_gives_up() {
        let memory = MemoryStore::default();
        let (a, b) = joined(&memory);
        let racing = Racing {
            inner: &memory,
            interleave: Cell::new(u32::MAX),
            rival_vm: b,
        };
        let err = update(&racing, KEY, |t: &mut ShardTable| {
            Change::Write(t.try_admit(a, 0, SlotKind::Priority, &LIMITS))
        })
        .unwrap_err();
        assert_eq!(err, (StoreError::Contended, MAX_ATTEMPTS));
    }

    #[test]
    fn keep_does_not_write() {
        let memory = MemoryStore::default();
        joined(&memory);
        let (_, before) = memory.load(KEY).unwrap();
        update(&memory, KEY, |_: &mut ShardTable| Change::Keep(())).unwrap();
        assert_eq!(memory.load(KEY).unwrap().1, before);
    }
}
