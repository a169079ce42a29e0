//! Reads at `latest` held for the head (`cache::head`): the requests a VM
//! holds until a head poll that started after them answers, and its one
//! poll in flight. The registry sends the poll from the root context
//! (`next`, `sent`) and settles the reads it covers when it ends
//! (`ended`), each through its `Place` (`Place::at_head`).

use super::reply::{Callout, Target};
use crate::cache::head::{self, Head};
use crate::dedup::answer::Answer;
use crate::dedup::policy::Upstream;

/// The stream id the registry gives the head poll in its callout queue
/// (Envoy numbers contexts from 1).
pub const HEAD_POLL: u32 = 0;

/// One VM's reads held for the head, and its head poll.
#[derive(Debug, Default)]
pub struct Heads {
    /// Held streams, by the order they came in (`seq`).
    held: Vec<(u32, u64)>,
    seq: u64,
    /// The poll in flight: its token, and the last read it covers.
    in_flight: Option<(u32, u64)>,
    /// The last read the poll being sent covers.
    sending: Option<u64>,
}

impl Heads {
    /// Holds stream `id`'s read; true if no poll is in flight, so one is
    /// to be sent (after the one in flight, else).
    pub fn hold(&mut self, id: u32) -> bool {
        self.seq += 1;
        self.held.push((id, self.seq));
        self.in_flight.is_none()
    }

    /// The poll to send now, if reads wait that no poll covers and none
    /// is in flight.
    pub fn next(&mut self, upstream: &Upstream, target: &Target) -> Option<Callout> {
        // Reads held while no poll is out are covered by none.
        if self.in_flight.is_some() || self.sending.is_some() {
            return None;
        }
        self.sending = Some(self.held.last()?.1);
        Some(Callout::post(
            &upstream.cluster,
            target,
            head::REQUEST.to_vec(),
            upstream.timeout_ms,
        ))
    }

    /// The poll went out as `token`; `None`: the host refused it, and the
    /// reads it would have covered are returned (they go on as they came).
    pub fn sent(&mut self, token: Option<u32>) -> Vec<u32> {
        let Some(last) = self.sending.take() else {
            return Vec::new();
        };
        match token {
            Some(token) => {
                self.in_flight = Some((token, last));
                Vec::new()
            }
            None => self.settled(last),
        }
    }

    /// Whether `token` is the head poll's.
    pub fn is_poll(&self, token: u32) -> bool {
        self.in_flight.is_some_and(|(t, _)| t == token)
    }

    /// The poll ended: the reads it covers, and the head it found (`None`:
    /// no head: no answer, an error, or not a block).
    pub fn ended(&mut self, answer: Option<Answer>) -> (Vec<u32>, Option<Head>) {
        let Some((_, last)) = self.in_flight.take() else {
            return (Vec::new(), None);
        };
        (self.settled(last), answer.and_then(Head::read))
    }

    /// Reads still held (some may have ended; the registry skips them).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    fn settled(&mut self, last: u64) -> Vec<u32> {
        let covered = self.held.partition_point(|(_, seq)| *seq <= last);
        self.held.drain(..covered).map(|(id, _)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream() -> Upstream {
        Upstream {
            cluster: "node".into(),
            timeout_ms: 1000,
        }
    }

    #[test]
    fn a_poll_settles_only_the_reads_that_came_before_it_went_out() {
        let mut heads = Heads::default();
        let target = Target::default();
        assert!(heads.next(&upstream(), &target).is_none(), "nothing held");
        assert!(heads.hold(7));
        assert!(heads.hold(8));
        let poll = heads.next(&upstream(), &target).unwrap();
        assert_eq!(poll.body, head::REQUEST);
        assert!(heads.next(&upstream(), &target).is_none(), "one at a time");
        assert!(heads.sent(Some(40)).is_empty());
        assert!(!heads.hold(9), "a poll is in flight");
        assert!(heads.next(&upstream(), &target).is_none(), "after it ends");
        assert!(heads.is_poll(40) && !heads.is_poll(41));
        let (settled, head) = heads.ended(None);
        assert_eq!((settled, head), (vec![7, 8], None));
        // Read 9 came while the poll was out: the next poll covers it.
        assert!(heads.next(&upstream(), &target).is_some());
        assert_eq!(heads.sent(None), vec![9], "refused: read 9 goes on");
        assert_eq!(heads.held(), 0);
    }
}
