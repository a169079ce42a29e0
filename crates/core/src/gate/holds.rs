//! Requests held at the gateway, bounded per worker and per identity.
//!
//! A request is **held** while it waits at the gateway for something other
//! than the node: a head poll (a read at `latest` with `cache.latest`), an
//! identical request's answer (coalescing), or a slot (`nodeTime.waitMs`).
//! A held request keeps its body in the VM's memory and a stream in Envoy,
//! so holding is bounded, and past a bound a request is refused at once
//! (rule `held`) instead of being held:
//!
//! - **per worker**: `maxHeld` requests; the default class stops at three
//!   quarters of it, so a public crowd always leaves the priority class
//!   (staked callers) room (503: the gateway is full);
//! - **per identity**: `maxHeldPerIdentity` of one identity on the worker,
//!   the identity as stake QoS named it (`request::IDENTITY_PROPERTY`; 429:
//!   this caller holds enough). While QoS only counts, far below its
//!   threshold, it names nobody, and its callers are bounded by their
//!   class.
//!
//! Internal requests are counted, never refused. A request is counted once
//! however many of those waits it goes through in turn (a read held for
//! the head, then for its pinned answer), until the gate lets it go on,
//! answers it, or it ends.

use super::class::RequestClass;
use crate::rejection::{Fact, Rejection, Rule, LIMIT_EXCEEDED};
use std::collections::HashMap;

/// One worker's held requests.
#[derive(Debug, Default)]
pub struct Holds {
    /// Each held stream's class and identity.
    streams: HashMap<u32, (RequestClass, Option<u64>)>,
    /// Held requests not internal.
    public: u32,
    by_identity: HashMap<u64, u32>,
}

impl Holds {
    /// Stream `id` of `class` is to be held: counted (once, if it is held
    /// already), or refused past a bound. `identity` is read only for a
    /// request that may be refused.
    pub fn hold(
        &mut self,
        id: u32,
        class: RequestClass,
        identity: impl FnOnce() -> Option<u64>,
        (max, per_identity): (u32, u32),
    ) -> Result<(), Rejection> {
        if self.streams.contains_key(&id) {
            return Ok(());
        }
        if class == RequestClass::Internal {
            self.streams.insert(id, (class, None));
            return Ok(());
        }
        let bound = match class {
            RequestClass::Default => max - max / 4,
            _ => max,
        };
        if self.public >= bound {
            return Err(refusal(Rejection::OVERLOADED, self.public, bound));
        }
        let identity = identity();
        if let Some(key) = identity {
            let held = self.by_identity.entry(key).or_default();
            if *held >= per_identity {
                let held = *held;
                return Err(refusal(Rejection::TOO_MANY_REQUESTS, held, per_identity));
            }
            *held += 1;
        }
        self.public += 1;
        self.streams.insert(id, (class, identity));
        Ok(())
    }

    /// Stream `id` is held no longer (let on, answered, refused or over).
    pub fn release(&mut self, id: u32) {
        let Some((class, identity)) = self.streams.remove(&id) else {
            return;
        };
        if class == RequestClass::Internal {
            return;
        }
        self.public -= 1;
        if let Some(key) = identity {
            if let Some(held) = self.by_identity.get_mut(&key) {
                *held -= 1;
                if *held == 0 {
                    self.by_identity.remove(&key);
                }
            }
        }
    }

    /// Requests held on this worker, internal ones included.
    pub fn held(&self) -> usize {
        self.streams.len()
    }
}

fn refusal(status: u32, held: u32, limit: u32) -> Rejection {
    let message = match status {
        Rejection::OVERLOADED => {
            "the gateway holds as many waiting requests as it may; retry after the retry-after header"
        }
        _ => "this client has as many requests waiting at the gateway as it may; retry after the retry-after header",
    };
    Rejection::explained(
        Rule::Held,
        status,
        1,
        LIMIT_EXCEEDED,
        message,
        &[Fact::Inflight(held), Fact::Limit(limit)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use RequestClass::{Default, Internal, Priority};

    const BOUNDS: (u32, u32) = (8, 3);

    #[test]
    fn the_default_class_leaves_a_quarter_to_the_priority_class() {
        let mut holds = Holds::default();
        for id in 0..6 {
            holds.hold(id, Default, || None, BOUNDS).unwrap();
        }
        let refused = holds.hold(6, Default, || None, BOUNDS).unwrap_err();
        assert_eq!((refused.status, refused.rule), (503, Rule::Held));
        assert!(
            refused.data.contains(r#""inFlight":6,"limit":6"#),
            "{}",
            refused.data
        );
        holds.hold(6, Priority, || None, BOUNDS).unwrap();
        holds.hold(7, Priority, || None, BOUNDS).unwrap();
        assert!(holds.hold(8, Priority, || None, BOUNDS).is_err());
        for id in 100..110 {
            holds.hold(id, Internal, || None, BOUNDS).unwrap();
        }
        assert_eq!(holds.held(), 18);
    }

    #[test]
    fn an_identity_holds_at_most_its_bound_and_others_are_not_touched() {
        let mut holds = Holds::default();
        for id in 0..3 {
            holds.hold(id, Default, || Some(7), BOUNDS).unwrap();
        }
        let refused = holds.hold(3, Default, || Some(7), BOUNDS).unwrap_err();
        assert_eq!((refused.status, refused.rule), (429, Rule::Held));
        holds.hold(3, Default, || Some(8), BOUNDS).unwrap();
        holds.release(0);
        holds.hold(4, Default, || Some(7), BOUNDS).unwrap();
    }

    #[test]
    fn a_stream_is_counted_once_and_every_release_brings_the_counts_back_to_zero() {
        let mut holds = Holds::default();
        let mut asked = 0;
        for _ in 0..3 {
            holds
                .hold(
                    1,
                    Default,
                    || {
                        asked += 1;
                        Some(7)
                    },
                    BOUNDS,
                )
                .unwrap();
        }
        assert_eq!(
            (holds.held(), asked),
            (1, 1),
            "held once, identity read once"
        );
        holds.hold(2, Internal, || Some(7), BOUNDS).unwrap();
        for id in [1, 2, 1, 9] {
            holds.release(id);
        }
        assert_eq!(holds.held(), 0);
        assert_eq!(holds.public, 0);
        assert!(holds.by_identity.is_empty());
    }
}
