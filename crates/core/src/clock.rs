//! The time as the filters' logic sees it: a value the caller passes in.
//!
//! In Envoy each clock read is a host call, and most of a stream's
//! callbacks never need the time, so the glue hands over a [`Now`] that
//! reads the host clock the first time it is asked and keeps the answer
//! for the rest of that callback. Tests and the simulator pass a fixed
//! time.

/// The current time, read at most once.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    us: Option<u64>,
    /// The host clock, in `scale` microseconds.
    read: fn() -> u64,
    scale: u64,
}

impl Now {
    /// Reads `read_us` (microseconds) when first asked.
    pub fn lazy_us(read_us: fn() -> u64) -> Self {
        Self {
            us: None,
            read: read_us,
            scale: 1,
        }
    }

    /// Reads `read_ms` (milliseconds) when first asked.
    pub fn lazy_ms(read_ms: fn() -> u64) -> Self {
        Self {
            us: None,
            read: read_ms,
            scale: 1000,
        }
    }

    /// Always `ms`.
    pub fn fixed(ms: u64) -> Self {
        Self::fixed_us(ms.saturating_mul(1000))
    }

    /// Always `us`.
    pub fn fixed_us(us: u64) -> Self {
        Self {
            us: Some(us),
            read: || 0,
            scale: 1,
        }
    }

    pub fn ms(&mut self) -> u64 {
        self.us() / 1000
    }

    pub fn us(&mut self) -> u64 {
        let (read, scale) = (self.read, self.scale);
        *self.us.get_or_insert_with(|| read().saturating_mul(scale))
    }

    /// Whether the time was needed.
    pub fn was_read(&self) -> bool {
        self.us.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    static READS: AtomicU64 = AtomicU64::new(0);

    fn host_us() -> u64 {
        READS.fetch_add(1, Ordering::Relaxed) + 1_000_500
    }

    #[test]
    fn the_host_clock_is_read_once_and_only_when_asked() {
        let mut now = Now::lazy_us(host_us);
        assert!(!now.was_read());
        assert_eq!(READS.load(Ordering::Relaxed), 0);
        assert_eq!(now.ms(), 1_000);
        assert_eq!(now.us(), 1_000_500);
        assert_eq!(now.ms(), 1_000);
        assert_eq!(READS.load(Ordering::Relaxed), 1);
        assert_eq!(Now::fixed(7).ms(), 7);
        assert_eq!(Now::fixed(7).us(), 7_000);
        assert_eq!(Now::lazy_ms(|| 9).us(), 9_000);
    }
}
