//! Service time per JSON-RPC method, and how the node spends it.
//!
//! A request holds its read slot for its method's cost. The work is a timer
//! sleep, not a CPU spin: the slots model database read transactions, whose
//! cost is mostly waiting on storage, and on a 2-core machine spinning would
//! make the mock's CPU the bottleneck instead of its slots. With sleeps the
//! capacity is `read_slots / cost` whatever the machine does. tokio's timer
//! rounds sleeps up to the next millisecond, so costs under 1 ms (such as
//! eth_blockNumber) are spun instead: they are short enough that spinning is
//! cheap, and sleeping would inflate them five-fold.

use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The default table. Methods not in it are unknown (-32601).
pub const DEFAULT_COSTS: &[(&str, Duration)] = &[
    ("eth_blockNumber", Duration::from_micros(200)),
    ("eth_chainId", Duration::from_micros(50)),
    ("net_version", Duration::from_micros(50)),
    ("web3_clientVersion", Duration::from_micros(50)),
    ("eth_getBalance", Duration::from_millis(1)),
    ("eth_getTransactionCount", Duration::from_millis(1)),
    ("eth_getBlockByNumber", Duration::from_millis(2)),
    ("eth_getTransactionReceipt", Duration::from_millis(2)),
    ("eth_sendRawTransaction", Duration::from_millis(3)),
    ("eth_call", Duration::from_millis(5)),
    ("eth_estimateGas", Duration::from_millis(8)),
    ("eth_getLogs", Duration::from_millis(20)),
    ("eth_getProof", Duration::from_millis(40)),
];

/// Which chain's JSON-RPC the node speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Flavour {
    /// Ethereum's `eth_*` methods (`DEFAULT_COSTS`).
    #[default]
    Ethereum,
    /// Solana's methods, slots and commitment levels (`solana::COSTS`).
    Solana,
}

#[derive(Debug, Clone)]
pub struct CostTable(BTreeMap<String, Duration>);

impl Default for CostTable {
    fn default() -> Self {
        Self::of(Flavour::Ethereum)
    }
}

impl CostTable {
    /// The default table of a flavour.
    pub fn of(flavour: Flavour) -> Self {
        let table = match flavour {
            Flavour::Ethereum => DEFAULT_COSTS,
            Flavour::Solana => crate::solana::COSTS,
        };
        Self(
            table
                .iter()
                .map(|(method, cost)| (method.to_string(), *cost))
                .collect(),
        )
    }

    /// Applies `METHOD=DURATION` overrides (e.g. `eth_call=10ms`); a method
    /// not in the table becomes known with that cost.
    pub fn with_overrides(mut self, overrides: &[String]) -> anyhow::Result<Self> {
        for entry in overrides {
            let Some((method, cost)) = entry.split_once('=') else {
                bail!("--cost {entry:?}: expected METHOD=DURATION, e.g. eth_call=5ms");
            };
            if method.is_empty() {
                bail!("--cost {entry:?}: the method name is empty");
            }
            let cost = humantime::parse_duration(cost)
                .with_context(|| format!("--cost {entry:?}: bad duration {cost:?}"))?;
            self.set(method, cost);
        }
        Ok(self)
    }

    /// `method` costs `cost` from now on.
    pub fn set(&mut self, method: &str, cost: Duration) {
        self.0.insert(method.to_string(), cost);
    }

    pub fn cost(&self, method: &str) -> Option<Duration> {
        self.0.get(method).copied()
    }

    pub fn methods(&self) -> impl Iterator<Item = (&str, Duration)> {
        self.0.iter().map(|(m, c)| (m.as_str(), *c))
    }
}

/// A method's cost from some time after the node's first request on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostChange {
    pub at: Duration,
    pub method: String,
    pub cost: Duration,
}

impl CostChange {
    /// `AT:METHOD=DURATION`, e.g. `10s:eth_call=50ms`.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let usage = || {
            format!("--cost-change {text:?}: expected AT:METHOD=DURATION, e.g. 10s:eth_call=50ms")
        };
        let (at, entry) = text.split_once(':').with_context(usage)?;
        let (method, cost) = entry.split_once('=').with_context(usage)?;
        if method.is_empty() {
            bail!(usage());
        }
        Ok(Self {
            at: humantime::parse_duration(at).with_context(usage)?,
            method: method.to_string(),
            cost: humantime::parse_duration(cost).with_context(usage)?,
        })
    }
}

/// Spends `cost` while the caller holds its slot.
pub async fn work(cost: Duration) {
    if cost >= Duration::from_millis(1) {
        tokio::time::sleep(cost).await;
    } else {
        let until = Instant::now() + cost;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cost_change_reads_when_which_and_how_much() {
        assert_eq!(
            CostChange::parse("10s:eth_call=50ms").unwrap(),
            CostChange {
                at: Duration::from_secs(10),
                method: "eth_call".into(),
                cost: Duration::from_millis(50),
            }
        );
        for bad in ["eth_call=5ms", "10s:eth_call", "x:eth_call=5ms", "1s:=5ms"] {
            assert!(CostChange::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults_match_the_documented_costs() {
        let table = CostTable::default();
        assert_eq!(
            table.cost("eth_blockNumber"),
            Some(Duration::from_micros(200))
        );
        assert_eq!(
            table.cost("eth_getBlockByNumber"),
            Some(Duration::from_millis(2))
        );
        assert_eq!(table.cost("eth_call"), Some(Duration::from_millis(5)));
        assert_eq!(table.cost("eth_getProof"), Some(Duration::from_millis(40)));
        assert_eq!(table.cost("eth_mine"), None);
    }

    #[test]
    fn overrides_replace_and_add_methods() {
        let table = CostTable::default()
            .with_overrides(&["eth_call=10ms".into(), "debug_traceCall=250ms".into()])
            .unwrap();
        assert_eq!(table.cost("eth_call"), Some(Duration::from_millis(10)));
        assert_eq!(
            table.cost("debug_traceCall"),
            Some(Duration::from_millis(250))
        );
    }

    #[test]
    fn bad_overrides_name_the_entry() {
        let err = CostTable::default()
            .with_overrides(&["eth_call".into()])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "--cost \"eth_call\": expected METHOD=DURATION, e.g. eth_call=5ms"
        );
        let err = CostTable::default()
            .with_overrides(&["eth_call=fast".into()])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "--cost \"eth_call=fast\": bad duration \"fast\""
        );
    }
}
