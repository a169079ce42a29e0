//! The run's pictures, as PNG: admitted rps per client over time, the
//! node's tip lag over time, and admitted shares against stake shares.
//!
//! Text is drawn with ab_glyph from a TrueType font read at run time:
//! `STAKEGATE_FONT`, or DejaVu Sans where Debian and others put it (Debian:
//! `apt-get install fonts-dejavu-core`; `make setup` does it).

use crate::summary::Summary;
use anyhow::{bail, Context};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const SIZE: (u32, u32) = (900, 480);
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
];
/// More lines than this and replicas (`id-1`, `id-2`, …) are drawn as one.
const MAX_LINES: usize = 8;

/// Registers the font once; the error says where it looked.
fn load_font() -> anyhow::Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let candidates: Vec<PathBuf> = match std::env::var_os("STAKEGATE_FONT") {
                Some(path) => vec![path.into()],
                None => FONTS.iter().map(PathBuf::from).collect(),
            };
            let Some((path, bytes)) = candidates
                .iter()
                .find_map(|p| Some((p, std::fs::read(p).ok()?)))
            else {
                return Err(format!(
                    "no TrueType font for the plots: looked for {}; install fonts-dejavu-core or set STAKEGATE_FONT",
                    candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                ));
            };
            // The plotting library keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{} is not a TrueType font", path.display()))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Draws the three plots into `dir` and returns their paths.
pub fn draw(summary: &Summary, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    load_font()?;
    let paths = [
        dir.join("admitted.png"),
        dir.join("tip_lag.png"),
        dir.join("shares.png"),
    ];
    admitted(summary, &paths[0]).context("admitted.png")?;
    tip_lag(summary, &paths[1]).context("tip_lag.png")?;
    shares(summary, &paths[2]).context("shares.png")?;
    Ok(paths.to_vec())
}

/// The line (and bar) a client is drawn in: its own, or its replica
/// group's (`id-1`, `id-2`, … as `id (all)`) when there are many clients.
fn line_name(id: &str, grouped: bool) -> String {
    match id.rsplit_once('-') {
        Some((base, n)) if grouped && n.parse::<u32>().is_ok() => format!("{base} (all)"),
        _ => id.to_string(),
    }
}

/// Per-second admitted counts by line.
fn lines(summary: &Summary) -> BTreeMap<String, Vec<u64>> {
    let grouped = summary.clients.len() > MAX_LINES;
    let mut lines: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for client in &summary.clients {
        let line = lines.entry(line_name(&client.id, grouped)).or_default();
        if line.len() < client.timeline.len() {
            line.resize(client.timeline.len(), 0);
        }
        for (slot, second) in line.iter_mut().zip(&client.timeline) {
            *slot += second.ok;
        }
    }
    lines
}

fn title(summary: &Summary, what: &str) -> String {
    format!("{} ({}): {what}", summary.scenario, summary.mode)
}

fn admitted(summary: &Summary, path: &Path) -> anyhow::Result<()> {
    let lines = lines(summary);
    let seconds = lines.values().map(Vec::len).max().unwrap_or(0).max(1);
    let top = lines
        .values()
        .flatten()
        .copied()
        .max()
        .unwrap_or(0)
        .max(summary.capacity_rps.min(1e9) as u64)
        .max(1) as f64
        * 1.1;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            title(summary, "admitted rps per client"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..seconds as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("second of the run")
        .y_desc("admitted rps")
        .draw()?;
    if summary.capacity_rps.is_finite() {
        let capacity = summary.capacity_rps;
        chart
            .draw_series(LineSeries::new(
                [(0.0, capacity), (seconds as f64, capacity)],
                BLACK.mix(0.4).stroke_width(1),
            ))?
            .label(format!("node capacity {capacity:.0} rps"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK.mix(0.4)));
    }
    // Each policy swap, where it was deployed (a failed one in red).
    for (i, swap) in summary.swaps.iter().enumerate() {
        let color = if swap.error.is_some() { RED } else { BLUE }.mix(0.5);
        let series = chart.draw_series(LineSeries::new(
            [(swap.at_s, 0.0), (swap.at_s, top)],
            color.stroke_width(1),
        ))?;
        if i == 0 {
            series
                .label("policy swap")
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color));
        }
    }
    for (i, (name, counts)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                counts
                    .iter()
                    .enumerate()
                    .map(|(s, n)| (s as f64 + 0.5, *n as f64)),
                color.stroke_width(2),
            ))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    legend_and_save(&mut chart, &root)
}

/// A chart drawn on `root` (borrowed for `'a`) of a bitmap backend (`'b`).
type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draws the chart's legend, top right, and writes the file.
fn legend_and_save<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    root: &DrawingArea<BitMapBackend<'b>, Shift>,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn tip_lag(summary: &Summary, path: &Path) -> anyhow::Result<()> {
    let Some(node) = &summary.node else {
        bail!("the run has no node to plot");
    };
    let lags: Vec<f64> = node.timeline.iter().map(|s| s.tip_lag_ms).collect();
    let seconds = lags.len().max(1) as f64;
    let top = lags
        .iter()
        .copied()
        .fold(node.tip_lag_max_ms, f64::max)
        .max(100.0)
        * 1.1;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            title(
                summary,
                &format!(
                    "node tip lag (max {:.0} ms, tip {})",
                    node.tip_lag_max_ms,
                    if node.tip_lost { "lost" } else { "held" }
                ),
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..seconds, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("second of the run")
        .y_desc("tip lag, ms (max in the second)")
        .draw()?;
    chart.draw_series(LineSeries::new(
        lags.iter()
            .enumerate()
            .map(|(s, lag)| (s as f64 + 0.5, *lag)),
        RED.stroke_width(2),
    ))?;
    root.present()?;
    Ok(())
}

fn shares(summary: &Summary, path: &Path) -> anyhow::Result<()> {
    // Shares per line: replicas add up.
    let grouped = summary.clients.len() > MAX_LINES;
    let mut bars: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for client in &summary.clients {
        let bar = bars.entry(line_name(&client.id, grouped)).or_default();
        bar.0 += client.admitted_share * 100.0;
        bar.1 += client.stake_share * 100.0;
    }
    let staked = summary.clients.iter().any(|c| c.stake > 0);
    let top = bars.values().map(|(a, s)| a.max(*s)).fold(10.0, f64::max) * 1.15;
    let names: Vec<&str> = bars.keys().map(String::as_str).collect();
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let caption = if staked {
        format!(
            "admitted share vs stake share (max error {:.1} pp)",
            summary.max_share_error_pp
        )
    } else {
        "admitted share (no stakes in this scenario)".to_string()
    };
    let mut chart = category_chart(
        &root,
        (&title(summary, &caption), 20),
        &names,
        top,
        "% of admitted requests / of stake",
    )?;
    let blue = BLUE.mix(0.8);
    let grey = BLACK.mix(0.35);
    chart
        .draw_series(bars.values().enumerate().map(|(i, (admitted, _))| {
            let x = i as f64;
            Rectangle::new([(x + 0.15, 0.0), (x + 0.48, *admitted)], blue.filled())
        }))?
        .label("admitted share")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], blue.filled()));
    if staked {
        chart
            .draw_series(bars.values().enumerate().map(|(i, (_, stake))| {
                let x = i as f64;
                Rectangle::new([(x + 0.52, 0.0), (x + 0.85, *stake)], grey.filled())
            }))?
            .label("stake share")
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], grey.filled()));
    }
    legend_and_save(&mut chart, &root)
}

/// A chart from 0 to `top` with one category per name along x (category
/// `i` spans `i..i + 1`), labelled under its middle.
fn category_chart<'a, 'b>(
    root: &'a DrawingArea<BitMapBackend<'b>, Shift>,
    (caption, size): (&str, u32),
    names: &[&str],
    top: f64,
    y_desc: &str,
) -> anyhow::Result<Chart<'a, 'b>> {
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", size))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..names.len() as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len() * 2 + 1)
        .x_label_formatter(&|x| category(names, *x))
        .y_desc(y_desc)
        .draw()?;
    Ok(chart)
}

/// The name of the category whose bar is centred at `x` (categories sit at
/// 0..1, 1..2, …), empty between them.
fn category(names: &[&str], x: f64) -> String {
    let i = x.floor() as usize;
    if (x - i as f64 - 0.5).abs() < 0.01 {
        names.get(i).map(|n| n.to_string()).unwrap_or_default()
    } else {
        String::new()
    }
}

/// One horizontal bar per `(name, value, [low, high])`, top to bottom, with
/// a whisker from low to high and a dashed line at 1.0: the bench's ratios.
pub fn bars(bars: &[(String, f64, [f64; 2])], caption: &str, path: &Path) -> anyhow::Result<()> {
    load_font()?;
    let names: Vec<&str> = bars.iter().rev().map(|(n, ..)| n.as_str()).collect();
    let top = bars
        .iter()
        .map(|(_, v, [_, high])| v.max(*high))
        .fold(1.0, f64::max)
        * 1.1;
    let height = (60 + 32 * bars.len() as u32).max(SIZE.1);
    let root = BitMapBackend::new(path, (SIZE.0, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(190)
        .build_cartesian_2d(0f64..top, 0f64..names.len() as f64)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(names.len() * 2 + 1)
        .y_label_formatter(&|y| category(&names, *y))
        .x_desc("ratio")
        .draw()?;
    let blue = BLUE.mix(0.7);
    let row = |i: usize| (bars.len() - 1 - i) as f64;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, value, _))| {
        Rectangle::new([(0.0, row(i) + 0.2), (*value, row(i) + 0.8)], blue.filled())
    }))?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, _, [low, high]))| {
        let y = row(i) + 0.5;
        PathElement::new([(*low, y), (*high, y)], BLACK.stroke_width(2))
    }))?;
    chart.draw_series(DashedLineSeries::new(
        [(1.0, 0.0), (1.0, names.len() as f64)],
        6,
        4,
        BLACK.mix(0.5).stroke_width(1),
    ))?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_chart_is_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bars.png");
        let rows = vec![
            ("no filter".to_string(), 1.0, [1.0, 1.0]),
            ("gate".to_string(), 0.8, [0.7, 0.9]),
        ];
        bars(&rows, "ratio to no filter", &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{} bytes", bytes.len());
    }
}
