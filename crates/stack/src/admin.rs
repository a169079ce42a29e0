//! Envoy's admin API, by URL: stats, text readouts and histograms. Used by
//! the stack's own `Envoy` handle and by `stakegate deploy`, which knows
//! only an admin address.

use crate::http;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admin {
    /// e.g. `http://127.0.0.1:9901`, without a trailing slash.
    pub url: String,
}

/// One quantile of an Envoy histogram; `None` where Envoy has no sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantile {
    pub percent: f64,
    pub interval: Option<f64>,
    pub cumulative: Option<f64>,
}

impl Admin {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.trim_end_matches('/').to_string(),
        }
    }

    /// The `/stats` entries whose name matches `name` exactly.
    fn exactly(&self, name: &str) -> anyhow::Result<Vec<serde_json::Value>> {
        self.matching(&format!("^{}$", name.replace('.', "\\.")))
    }

    /// The `/stats` entries whose name matches the regex `filter`, in one
    /// request: counters and gauges as numbers, text readouts as strings.
    pub fn matching(&self, filter: &str) -> anyhow::Result<Vec<serde_json::Value>> {
        let doc = http::get(&format!("{}/stats?format=json&filter={filter}", self.url))?.json()?;
        Ok(doc["stats"].as_array().cloned().unwrap_or_default())
    }

    /// Counters and gauges, by name.
    pub fn stats(&self) -> anyhow::Result<BTreeMap<String, i64>> {
        let doc = http::get(&format!("{}/stats?format=json", self.url))?.json()?;
        Ok(doc["stats"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|stat| Some((stat["name"].as_str()?.to_string(), stat["value"].as_i64()?)))
            .collect())
    }

    /// One counter or gauge; 0 if Envoy has not created it yet.
    pub fn stat(&self, name: &str) -> anyhow::Result<i64> {
        Ok(self
            .exactly(name)?
            .iter()
            .find(|stat| stat["name"] == name)
            .and_then(|stat| stat["value"].as_i64())
            .unwrap_or(0))
    }

    /// A text readout (e.g. an ECDS resource's `version_text`).
    pub fn text(&self, name: &str) -> anyhow::Result<Option<String>> {
        Ok(self
            .exactly(name)?
            .iter()
            .find(|stat| stat["name"] == name)
            .and_then(|stat| stat["value"].as_str().map(str::to_string)))
    }

    /// A histogram's quantiles: (quantile in percent, value over the last
    /// stats flush interval, value since start). Empty if Envoy has not
    /// recorded it yet.
    pub fn histogram(&self, name: &str) -> anyhow::Result<Vec<Quantile>> {
        let stats = self.exactly(name)?;
        let Some(histograms) = stats.iter().find_map(|stat| stat.get("histograms")) else {
            return Ok(Vec::new());
        };
        let quantiles = histograms["supported_quantiles"].as_array();
        let values = histograms["computed_quantiles"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|h| h["name"] == name)
            .and_then(|h| h["values"].as_array());
        Ok(quantiles
            .into_iter()
            .flatten()
            .zip(values.into_iter().flatten())
            .map(|(q, v)| Quantile {
                percent: q.as_f64().unwrap_or(0.0),
                interval: v["interval"].as_f64(),
                cumulative: v["cumulative"].as_f64(),
            })
            .collect())
    }
}
