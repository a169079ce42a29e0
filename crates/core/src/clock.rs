//! The time as the filters' logic sees it: a value the caller passes in.
//!
//! In Envoy each clock read is a host call, and most of a stream's
//! callbacks never need the time, so the glue hands over a [`Now`] that
//! reads the host clock the first time it is asked and keeps the answer
//! for the rest of that callback. Tests and the simulator pass a fixed
//! time.

/// The current time in milliseconds, read at most once.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    ms: Option<u64>,
    read: fn() -> u64,
}

impl Now {
    /// Reads `read` when first asked.
    pub fn lazy(read: fn() -> u64) -> Self {
        Self { ms: None, read }
    }

    /// Always `ms`.
    pub fn fixed(ms: u64) -> Self {
        Self {
            ms: Some(ms),
            read: || 0,
        }
    }

    pub fn ms(&mut self) -> u64 {
        *self.ms.get_or_insert_with(self.read)
    }

    /// Whether the time was needed.
    pub fn was_read(&self) -> bool {
        self.ms.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    static READS: AtomicU64 = AtomicU64::new(0);

    fn host() -> u64 {
        READS.fetch_add(1, Ordering::Relaxed) + 1_000
    }

    #[test]
    fn the_host_clock_is_read_once_and_only_when_asked() {
        let mut now = Now::lazy(host);
        assert!(!now.was_read());
        assert_eq!(READS.load(Ordering::Relaxed), 0);
        assert_eq!(now.ms(), 1_000);
        assert_eq!(now.ms(), 1_000);
        assert_eq!(READS.load(Ordering::Relaxed), 1);
        assert_eq!(Now::fixed(7).ms(), 7);
    }
}
