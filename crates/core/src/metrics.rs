//! Metrics as the filters declare them: each filter has one list of
//! `Metric`s (`gate::counts::METRICS`, `qos::counts::METRICS`) that gives
//! every metric's name, its kind, and how its value is read from what the
//! filter counted since the last flush (a snapshot). The glue defines
//! Envoy stats from the list and flushes a snapshot through it; the docs
//! check (`stakegate docs --check`) compares the list with the metric
//! tables in `policies/`. Nothing else names a metric.
//!
//! A name may hold one `<label>` placeholder (`admitted.<class>`): the
//! metric is then one stat per label the filter gives when it defines
//! them (the gate's classes, the QoS policy's tiers), read with the
//! label's index.

/// What kind of stat a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only grows: the flush adds what was counted since the last one.
    Counter,
    /// A value the flush sets (or, for a gauge every VM adds its part to,
    /// changes).
    Gauge,
    /// Values recorded one by one.
    Histogram,
}

impl Kind {
    /// As the docs' tables name it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// What a flush does with one stat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reading<'a> {
    /// Nothing: the snapshot does not have it.
    Skip,
    /// Add to a counter (0 costs nothing).
    Add(u64),
    /// Set a gauge.
    Set(u64),
    /// Change a gauge every VM adds its part to.
    Change(i64),
    /// Record each value in a histogram.
    Record(&'a [u64]),
}

/// One metric of a filter, read from its snapshot `T`.
pub struct Metric<T> {
    /// The name after the filter's prefix (`stakegate.gate.`), with at
    /// most one `<label>` placeholder.
    pub name: &'static str,
    pub kind: Kind,
    /// Its reading in a snapshot, for the label at that index (0 for a
    /// metric without a placeholder).
    pub read: for<'a> fn(&'a T, usize) -> Reading<'a>,
}

impl<T> Metric<T> {
    /// The stats' names for `labels`: one per label if the name has a
    /// placeholder, else the name alone.
    pub fn names(&self, labels: &[String]) -> Vec<String> {
        match (self.name.find('<'), self.name.find('>')) {
            (Some(open), Some(close)) if open < close => labels
                .iter()
                .map(|label| format!("{}{label}{}", &self.name[..open], &self.name[close + 1..]))
                .collect(),
            _ => vec![self.name.to_string()],
        }
    }
}

/// A counter's reading: its count.
pub fn add(n: u64) -> Reading<'static> {
    Reading::Add(n)
}

/// A gauge's reading, if the snapshot has a value.
pub fn set(value: Option<u64>) -> Reading<'static> {
    value.map_or(Reading::Skip, Reading::Set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placeholder_makes_a_stat_per_label() {
        let per_tier: Metric<()> = Metric {
            name: "admitted.<tier>",
            kind: Kind::Counter,
            read: |_, _| Reading::Skip,
        };
        let labels = ["staked".to_string(), "gold".to_string()];
        assert_eq!(
            per_tier.names(&labels),
            ["admitted.staked", "admitted.gold"]
        );
        let plain: Metric<()> = Metric {
            name: "rounds",
            kind: Kind::Counter,
            read: |_, _| Reading::Skip,
        };
        assert_eq!(plain.names(&labels), ["rounds"]);
    }
}
