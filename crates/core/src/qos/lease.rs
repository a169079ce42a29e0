//! Leases: how a worker takes tokens from an identity's shared bucket
//! (`StakeQos::admit_at`, and a socket's calls in `socket`). A lease asks
//! for a quarter of the identity's grant per round (what the request
//! needs, at least), by one CAS on the identity's page, and the worker
//! spends it locally; a worker that found the bucket empty does not look
//! again until the next round.

use super::identity::Identity;
use super::page::{page_key, Entry, Page, SATISFIED, STAKED};
use super::{Local, StakeQos, LEASE_DIVISOR};
use crate::shared::{update, SharedStore, StoreError};

/// What a lease took from a shared bucket, and what the bucket says of
/// its identity.
pub(super) struct Leased {
    pub(super) got: i64,
    pub(super) grant: u64,
    pub(super) demand: f32,
    pub(super) satisfied: bool,
    pub(super) retries: u32,
    /// An identity was evicted to make room for this one.
    pub(super) evicted: bool,
}

impl StakeQos {
    /// Takes up to `want` from the identity's shared bucket in page `page`
    /// (creating its entry with the new-identity gift if the table has
    /// none).
    pub(super) fn lease(
        &self,
        store: &impl SharedStore,
        now_ms: u64,
        identity: &Identity,
        page: u32,
        want: i64,
    ) -> Result<Leased, (StoreError, u32)> {
        let initial = i64::from(self.policy.initial_tokens) * self.default_cost();
        let fresh = Entry {
            key: identity.key,
            stake: identity.stake,
            tokens: initial,
            tier: identity.tier as u8,
            flags: if identity.staked { STAKED } else { 0 },
            last_seen_ms: now_ms,
            ..Entry::default()
        };
        let key = page_key(page);
        let updated = update(store, &key, |p: &mut Page| {
            let before = p.len();
            let (i, evicted) = p.entry(&fresh);
            let tokens = p.tokens(i);
            let got = tokens.clamp(0, want);
            p.set_tokens(i, tokens - got);
            p.set_last_seen_ms(i, now_ms);
            let satisfied = p.flags(i) & SATISFIED != 0;
            let value = (got, p.grant(i), p.demand(i), satisfied, evicted);
            if got > 0 || evicted || p.len() != before {
                crate::shared::Change::Write(value)
            } else {
                crate::shared::Change::Keep(value)
            }
        })?;
        let (got, grant, demand, satisfied, evicted) = updated.value;
        Ok(Leased {
            got,
            grant,
            demand,
            satisfied,
            retries: updated.retries,
            evicted,
        })
    }
}

impl Local {
    /// The lease an identity asks its bucket for, if its lease is short of
    /// `need` and its bucket was not found empty this round: its page, and
    /// a quarter of a round's grant (`need` at least) plus the debt a batch
    /// left.
    pub(super) fn lease_want(&self, need: i64, round: u64) -> Option<(u32, i64)> {
        (self.lease < need && self.dry_round != Some(round)).then(|| {
            let want = (self.grant / LEASE_DIVISOR).max(need as u64) as i64;
            (self.page, want + (-self.lease).max(0))
        })
    }

    /// A lease of `want` got `leased.got`, and says what the bucket
    /// knows of the identity.
    pub(super) fn took_lease(&mut self, leased: &Leased, want: i64, round: u64) {
        self.lease += leased.got;
        self.grant = leased.grant;
        self.demand = leased.demand;
        self.satisfied = leased.satisfied;
        if leased.got < want {
            // The bucket is empty now: no use looking again this round.
            self.dry_round = Some(round);
        }
    }
}
