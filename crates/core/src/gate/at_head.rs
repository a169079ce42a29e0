//! Reads at `latest` held for the head (`cache::head`): the requests a VM
//! holds until a head poll that started after them answers, and its one
//! poll in flight. The registry sends the poll from the root context
//! (`next`, `sent`) and settles the reads it covers when it ends
//! (`ended`), each through its `Place` (`Place::at_head`).
//!
//! **Standing by while holding does not pay.** A poll is a call at the
//! node, and a read of state that misses is one more; holding saves
//! calls only where reads share polls and answers (many clients at one
//! head). So each VM counts, over `JUDGE_EVERY` reads settled, the
//! node calls made for them (polls, pinned reads sent, reads let on);
//! with as many calls as reads it stands by: reads at `latest` go on to
//! the node at once, as without `cache.latest`, but one in
//! `SAMPLE_EVERY`, which is held. If two or more reads at `latest` come
//! while a sample's poll is out, they could have shared it: holding
//! starts again.

use super::reply::{Callout, Target};
use crate::cache::head::{self, Head};
use crate::dedup::answer::Answer;
use crate::dedup::policy::Upstream;

/// The stream id the registry gives the head poll in its callout queue
/// (Envoy numbers contexts from 1).
pub const HEAD_POLL: u32 = 0;

/// Reads settled over which a VM judges whether holding pays.
pub const JUDGE_EVERY: u64 = 256;
/// Standing by, one read at `latest` in this many is held.
pub const SAMPLE_EVERY: u64 = 16;

/// What to do with a read at `latest` that came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Held, and no poll is out: one is to be sent.
    Poll,
    /// Held for the poll after the one out.
    Wait,
    /// Standing by: it goes on to the node as it came.
    Pass,
}

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
    standing_by: bool,
    /// Engaged: reads settled in this window, and the node calls made
    /// for them. Standing by: reads passed since the last sample.
    reads: u64,
    calls: u64,
    /// Standing by: reads passed while a sample's poll was out.
    overlapped: u64,
}

impl Heads {
    /// Stream `id`'s read at `latest` came: held (for the next poll), or
    /// passed while holding does not pay.
    pub fn hold(&mut self, id: u32) -> Hold {
        if self.standing_by {
            let sampling = self.in_flight.is_some() || self.sending.is_some();
            self.overlapped += u64::from(sampling);
            self.reads += 1;
            if sampling || self.reads < SAMPLE_EVERY {
                return Hold::Pass;
            }
            self.reads = 0;
        }
        self.seq += 1;
        self.held.push((id, self.seq));
        match self.in_flight {
            None => Hold::Poll,
            Some(_) => Hold::Wait,
        }
    }

    /// `reads` settled by one poll, with `calls` at the node for them
    /// (the poll's own included): whether holding paid.
    pub fn judge(&mut self, reads: u64, calls: u64) {
        if self.standing_by {
            if std::mem::take(&mut self.overlapped) >= 2 {
                *self = Self {
                    held: std::mem::take(&mut self.held),
                    in_flight: self.in_flight,
                    sending: self.sending,
                    seq: self.seq,
                    ..Self::default()
                };
            }
            return;
        }
        self.reads += reads;
        self.calls += calls;
        if self.reads >= JUDGE_EVERY {
            self.standing_by = self.calls >= self.reads;
            (self.reads, self.calls) = (0, 0);
        }
    }

    /// Whether reads at `latest` go on at once (holding did not pay).
    pub fn standing_by(&self) -> bool {
        self.standing_by
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
        assert_eq!(heads.hold(7), Hold::Poll);
        assert_eq!(heads.hold(8), Hold::Poll);
        let poll = heads.next(&upstream(), &target).unwrap();
        assert_eq!(poll.body, head::REQUEST);
        assert!(heads.next(&upstream(), &target).is_none(), "one at a time");
        assert!(heads.sent(Some(40)).is_empty());
        assert_eq!(heads.hold(9), Hold::Wait, "a poll is in flight");
        assert!(heads.next(&upstream(), &target).is_none(), "after it ends");
        assert!(heads.is_poll(40) && !heads.is_poll(41));
        let (settled, head) = heads.ended(None);
        assert_eq!((settled, head), (vec![7, 8], None));
        // Read 9 came while the poll was out: the next poll covers it.
        assert!(heads.next(&upstream(), &target).is_some());
        assert_eq!(heads.sent(None), vec![9], "refused: read 9 goes on");
        assert_eq!(heads.held(), 0);
    }

    /// One read per poll and a call each: holding saves nothing, and the
    /// VM stands by, holding one read in `SAMPLE_EVERY`, until reads come
    /// while a sample's poll is out.
    #[test]
    fn with_a_call_for_every_read_holding_stands_by_until_reads_could_share_a_poll() {
        let mut heads = Heads::default();
        let (target, mut id) = (Target::default(), 0);
        let poll = |heads: &mut Heads, token: u32| {
            heads.next(&upstream(), &target).unwrap();
            heads.sent(Some(token));
            let (settled, _) = heads.ended(None);
            heads.judge(settled.len() as u64, 2);
        };
        for token in 0..JUDGE_EVERY as u32 {
            id += 1;
            assert_eq!(heads.hold(id), Hold::Poll);
            poll(&mut heads, token);
        }
        assert!(heads.standing_by());
        let held = (0..3 * SAMPLE_EVERY as u32)
            .filter(|_| {
                id += 1;
                let held = heads.hold(id) == Hold::Poll;
                if held {
                    poll(&mut heads, 1000 + id);
                }
                held
            })
            .count();
        assert_eq!(held, 3, "one in {SAMPLE_EVERY}");
        assert!(heads.standing_by());
        // Reads come while a sample's poll is out: they could share it.
        for _ in 0..SAMPLE_EVERY - 1 {
            id += 1;
            assert_eq!(heads.hold(id), Hold::Pass);
        }
        id += 1;
        assert_eq!(heads.hold(id), Hold::Poll, "a sample");
        heads.next(&upstream(), &target).unwrap();
        heads.sent(Some(5000));
        for _ in 0..2 {
            id += 1;
            assert_eq!(heads.hold(id), Hold::Pass);
        }
        let (settled, _) = heads.ended(None);
        heads.judge(settled.len() as u64, 1);
        assert!(!heads.standing_by(), "holding again");
        id += 1;
        assert_eq!(heads.hold(id), Hold::Poll);
    }
}
