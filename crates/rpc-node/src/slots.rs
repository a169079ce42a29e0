//! The node's read slots: a semaphore that RPC requests and the sync loop
//! share, with a *blocking* acquire and an unbounded FIFO wait queue.
//!
//! This is the pre-fix Erigon behaviour of docs/background.md part 5: every RPC request
//! waits for a database read transaction however long the queue is. Once the
//! queue is long, the sync loop's own acquire sits behind all of it, and the
//! node falls behind the chain tip. tokio's semaphore is fair (first come,
//! first served), which is exactly that starvation.
//!
//! RPC waiters are counted (`queue_depth`, `queue_max`); the count is kept by a
//! guard, so a request whose future is dropped while it waits (client gone)
//! leaves the count correct.

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{Semaphore, SemaphorePermit};

#[derive(Debug)]
pub struct ReadSlots {
    semaphore: Semaphore,
    total: u32,
    waiting: AtomicU64,
    waiting_max: AtomicU64,
}

/// Decrements the waiting count however the wait ends.
struct Waiting<'a>(&'a ReadSlots);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ReadSlots {
    pub fn new(total: u32) -> Self {
        Self {
            semaphore: Semaphore::new(total as usize),
            total,
            waiting: AtomicU64::new(0),
            waiting_max: AtomicU64::new(0),
        }
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    /// An RPC request's blocking acquire of one slot. Counted in the queue.
    pub async fn acquire_for_rpc(&self) -> SemaphorePermit<'_> {
        let depth = self.waiting.fetch_add(1, Ordering::Relaxed) + 1;
        self.waiting_max.fetch_max(depth, Ordering::Relaxed);
        let _waiting = Waiting(self);
        self.acquire(1).await
    }

    /// The sync loop's blocking acquire of `n` slots, queued behind every RPC
    /// request that arrived before it.
    pub async fn acquire_for_sync(&self, n: u32) -> SemaphorePermit<'_> {
        self.acquire(n).await
    }

    async fn acquire(&self, n: u32) -> SemaphorePermit<'_> {
        // The semaphore is never closed, so acquire only fails if `n` exceeds
        // the total, which the configuration forbids; waiting forever is the
        // honest behaviour of a blocking acquire in that impossible case.
        match self.semaphore.acquire_many(n).await {
            Ok(permit) => permit,
            Err(_) => std::future::pending().await,
        }
    }

    /// RPC requests waiting for a slot right now.
    pub fn queue_depth(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn queue_max(&self) -> u64 {
        self.waiting_max.load(Ordering::Relaxed)
    }

    pub fn in_use(&self) -> u32 {
        self.total
            .saturating_sub(self.semaphore.available_permits() as u32)
    }

    pub fn reset_maxima(&self) {
        self.waiting_max
            .store(self.waiting.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::sync::Arc;
    use std::task::Poll;

    async fn until(mut condition: impl FnMut() -> bool) {
        for _ in 0..10_000 {
            if condition() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("condition not reached");
    }

    #[tokio::test]
    async fn waiters_queue_without_bound_and_are_counted() {
        let slots = Arc::new(ReadSlots::new(2));
        let a = slots.acquire_for_rpc().await;
        let _b = slots.acquire_for_rpc().await;
        assert_eq!(slots.queue_depth(), 0);
        assert_eq!(slots.in_use(), 2);

        let waiters: Vec<_> = (0..500)
            .map(|_| {
                let slots = slots.clone();
                tokio::spawn(async move {
                    let _permit = slots.acquire_for_rpc().await;
                })
            })
            .collect();
        until(|| slots.queue_depth() == 500).await;
        assert_eq!(slots.queue_max(), 500);

        drop(a);
        for waiter in waiters {
            waiter.await.unwrap();
        }
        assert_eq!(slots.queue_depth(), 0);
        assert_eq!(slots.queue_max(), 500, "the maximum is kept");
        assert_eq!(slots.in_use(), 1);
    }

    #[tokio::test]
    async fn an_abandoned_wait_leaves_the_queue() {
        let slots = Arc::new(ReadSlots::new(1));
        let _held = slots.acquire_for_rpc().await;
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move {
                let _permit = slots.acquire_for_rpc().await;
            })
        };
        until(|| slots.queue_depth() == 1).await;
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(slots.queue_depth(), 0);
    }

    #[tokio::test]
    async fn sync_waits_behind_earlier_rpc_waiters() {
        let slots = Arc::new(ReadSlots::new(2));
        let held = slots.acquire_for_rpc().await;
        let held2 = slots.acquire_for_rpc().await;
        let rpc = {
            let slots = slots.clone();
            tokio::spawn(async move {
                let _p = slots.acquire_for_rpc().await;
            })
        };
        until(|| slots.queue_depth() == 1).await;
        // The sync loop's acquire joins the queue on its first poll.
        let mut sync = std::pin::pin!(slots.acquire_for_sync(2));
        let first = std::future::poll_fn(|cx| Poll::Ready(sync.as_mut().poll(cx))).await;
        assert!(first.is_pending());
        drop(held);
        drop(held2);
        // Had the sync loop been served first, it would hold both slots and
        // the RPC waiter could not finish.
        until(|| rpc.is_finished()).await;
        rpc.await.unwrap();
        assert_eq!(sync.await.num_permits(), 2);
    }

    #[tokio::test]
    async fn reset_keeps_the_current_depth_as_the_new_maximum() {
        let slots = Arc::new(ReadSlots::new(1));
        let _held = slots.acquire_for_rpc().await;
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move {
                let _permit = slots.acquire_for_rpc().await;
            })
        };
        until(|| slots.queue_depth() == 1).await;
        slots.reset_maxima();
        assert_eq!(slots.queue_max(), 1);
        waiter.abort();
    }
}
