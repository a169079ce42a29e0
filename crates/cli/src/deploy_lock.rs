//! The deploy lock of an ECDS directory: one deploy, rollback, shadow
//! deploy, promote or drop at a time, in the order they asked.
//!
//! An OS file lock alone is not fair: a loop of rollbacks that takes the
//! lock again the moment it lets go can keep a deploy waiting for as long
//! as it runs. So each taker first draws a ticket (a number from a counter
//! kept under a brief lock of its own) and leaves it in `queue/` as a file
//! it holds locked while it waits and works; it goes on when no lower
//! ticket's file is held. A taker that died leaves a ticket nobody holds:
//! it is removed, not waited for. The turn is then taken with the
//! directory's `lock` file, which older stakegates take alone.

use anyhow::{bail, Context};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A deploy's turn: held until dropped.
#[derive(Debug)]
pub struct DeployLock {
    _lock: File,
    _ticket: Ticket,
}

/// A ticket in the queue, removed when dropped.
#[derive(Debug)]
struct Ticket {
    path: PathBuf,
    _held: File,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl DeployLock {
    /// Takes the turn in the state directory `state` (`.stakegate/`),
    /// after every taker that asked before, waiting up to `wait`.
    pub fn take(state: &Path, wait: Duration) -> anyhow::Result<Self> {
        let started = Instant::now();
        let queue = state.join("queue");
        std::fs::create_dir_all(&queue).with_context(|| format!("creating {}", queue.display()))?;
        let ticket = draw(state, &queue)?;
        let number = number_of(&ticket.path).unwrap_or(0);
        while let Some(ahead) = first_ahead(&queue, number)? {
            if started.elapsed() >= wait {
                bail!(
                    "{} waited {wait:?} for its turn behind another deploy or rollback (pid {}); nothing was changed",
                    std::process::id(),
                    std::fs::read_to_string(&ahead).unwrap_or_default().trim()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let path = state.join("lock");
        let file = open(&path)?;
        // Those ahead are done: the lock is free, or held by an older
        // stakegate that takes no ticket, for which we wait too.
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if started.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(std::fs::TryLockError::WouldBlock) => bail!(
                    "another deploy or rollback holds {} and did not finish within {wait:?}; nothing was changed",
                    path.display()
                ),
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("locking {}", path.display()))
                }
            }
        }
        std::fs::write(&path, std::process::id().to_string())?;
        Ok(Self {
            _lock: file,
            _ticket: ticket,
        })
    }
}

fn open(path: &Path) -> anyhow::Result<File> {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

/// Draws the next ticket and leaves it, held, in `queue`.
fn draw(state: &Path, queue: &Path) -> anyhow::Result<Ticket> {
    let path = state.join("ticket");
    let mut counter = open(&path)?;
    counter
        .lock()
        .with_context(|| format!("locking {}", path.display()))?;
    let mut text = String::new();
    counter.read_to_string(&mut text)?;
    let number = text.trim().parse::<u64>().unwrap_or(0) + 1;
    let path = queue.join(format!("{number:020}"));
    let held = open(&path)?;
    held.lock()
        .with_context(|| format!("locking {}", path.display()))?;
    std::fs::write(&path, std::process::id().to_string())?;
    counter.set_len(0)?;
    counter.rewind()?;
    counter.write_all(number.to_string().as_bytes())?;
    Ok(Ticket { path, _held: held })
}

fn number_of(path: &Path) -> Option<u64> {
    path.file_name()?.to_str()?.parse().ok()
}

/// The first ticket below `number` whose taker is still there; tickets
/// whose taker is gone are removed.
fn first_ahead(queue: &Path, number: u64) -> anyhow::Result<Option<PathBuf>> {
    let mut ahead: Vec<(u64, PathBuf)> = std::fs::read_dir(queue)
        .with_context(|| format!("reading {}", queue.display()))?
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            number_of(&path).filter(|&n| n < number).map(|n| (n, path))
        })
        .collect();
    ahead.sort();
    for (_, path) in ahead {
        let Ok(file) = OpenOptions::new().read(true).open(&path) else {
            continue; // removed meanwhile: its taker is done
        };
        match file.try_lock() {
            Err(std::fs::TryLockError::WouldBlock) => return Ok(Some(path)),
            // Nobody holds it: its taker died waiting or working.
            Ok(()) => {
                let _ = std::fs::remove_file(&path);
            }
            Err(std::fs::TryLockError::Error(_)) => {}
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    impl DeployLock {
        fn ticket(&self) -> u64 {
            number_of(&self._ticket.path).unwrap()
        }
    }

    /// While a deploy waits, a loop that takes and leaves the lock as fast
    /// as it can (as a rollback or `--drop` loop does) gets at most the
    /// turn it asked for before the deploy: the deploy is next.
    #[test]
    fn a_taker_goes_before_everyone_who_asked_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().to_path_buf();
        let order = Arc::new(Mutex::new(Vec::new()));
        let first = DeployLock::take(&state, Duration::from_secs(60)).unwrap();
        let looper = {
            let (state, order) = (state.clone(), order.clone());
            std::thread::spawn(move || {
                for _ in 0..20 {
                    let _turn = DeployLock::take(&state, Duration::from_secs(60)).unwrap();
                    order.lock().unwrap().push("loop");
                }
            })
        };
        // The looper's first ticket is drawn (2), then the deploy's (3).
        while queued(&state) < 2 {
            std::thread::yield_now();
        }
        let deploy = {
            let (state, order) = (state.clone(), order.clone());
            std::thread::spawn(move || {
                let turn = DeployLock::take(&state, Duration::from_secs(60)).unwrap();
                order.lock().unwrap().push("deploy");
                turn.ticket()
            })
        };
        while queued(&state) < 3 {
            std::thread::yield_now();
        }
        drop(first);
        assert_eq!(deploy.join().unwrap(), 3);
        looper.join().unwrap();
        let order = order.lock().unwrap();
        assert_eq!(order.len(), 21);
        assert_eq!(order[..2], ["loop", "deploy"], "{order:?}");
    }

    /// A ticket left by a taker that died is not waited for.
    #[test]
    fn a_dead_taker_s_ticket_is_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let queue = dir.path().join("queue");
        std::fs::create_dir_all(&queue).unwrap();
        std::fs::write(dir.path().join("ticket"), "4").unwrap();
        std::fs::write(queue.join(format!("{:020}", 4)), "99999").unwrap();
        let turn = DeployLock::take(dir.path(), Duration::from_secs(60)).unwrap();
        assert_eq!(turn.ticket(), 5);
        assert!(!queue.join(format!("{:020}", 4)).exists());
        drop(turn);
        assert_eq!(std::fs::read_dir(&queue).unwrap().count(), 0);
    }

    fn queued(state: &Path) -> usize {
        std::fs::read_dir(state.join("queue"))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}
