//! A child process that is always stopped, and whose log is shown when the
//! test (or run) that owns it fails.

use std::path::{Path, PathBuf};
use std::process::Child;

#[derive(Debug)]
pub struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
    /// Print the log on drop even when not panicking.
    pub show_log_on_drop: bool,
}

impl Process {
    pub fn new(name: &'static str, child: Child, log: PathBuf) -> Self {
        Self {
            name,
            child,
            log,
            show_log_on_drop: false,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Asks the process to stop (SIGTERM), then kills it if it has not
    /// exited within `grace`.
    pub fn stop(&mut self, grace: std::time::Duration) {
        if self.exited().is_some() {
            return;
        }
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop(std::time::Duration::from_secs(2));
        if std::thread::panicking() || self.show_log_on_drop {
            eprintln!(
                "===== {} log ({}) =====\n{}\n===== end of {} log =====",
                self.name,
                self.log.display(),
                self.log_tail(400),
                self.name
            );
        }
    }
}
