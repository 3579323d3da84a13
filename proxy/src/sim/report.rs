//! The simulator's outputs: a table for the terminal, the miss-ratio plot (SVG, drawn
//! with `plotters`). The JSON is the [`Report`] serialized as is.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use super::Report;

/// One line per (capacity, policy): hit rate, share of the LRU-to-OPT gap closed.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "trace {} ({} requests, {} distinct blocks, {} B blocks, {} rules)",
        r.trace, r.requests, r.distinct_blocks, r.block_size, r.rules
    );
    let _ = writeln!(
        out,
        "{:>9} {:>24} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "capacity",
        "policy",
        "hit rate",
        "gap closed",
        "stored",
        "evicted",
        "refused",
        "occupied",
        "seconds"
    );
    let mut by_cap: BTreeMap<u64, Vec<&super::Row>> = BTreeMap::new();
    for row in &r.results {
        by_cap.entry(row.capacity_bytes).or_default().push(row);
    }
    for rows in by_cap.values() {
        let rate = |name: &str| rows.iter().find(|x| x.policy == name).map(|x| x.hit_rate);
        let (lru, opt) = (rate("lru"), rate("opt"));
        for row in rows {
            let occupied = if row.counts.occupancy_ppm > 0 {
                format!("{:.1} %", row.counts.occupancy_ppm as f64 / 1e4)
            } else {
                "-".into()
            };
            let gap = match (lru, opt) {
                (Some(l), Some(o)) if o > l => {
                    format!("{:+.1} %", (row.hit_rate - l) / (o - l) * 100.0)
                }
                _ => "-".into(),
            };
            let _ = writeln!(
                out,
                "{:>8.2}% {:>24} {:>9.4} {:>12} {:>9} {:>9} {:>9} {:>9} {:>8.3}",
                row.capacity_fraction * 100.0,
                row.policy,
                row.hit_rate,
                gap,
                row.counts.stored,
                row.counts.evicted,
                row.counts.refused,
                occupied,
                row.seconds
            );
        }
    }
    out
}

/// The miss-ratio curve of every policy over the capacities.
pub fn plot_svg(r: &Report, path: &Path) -> Result<(), String> {
    let mut series: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for row in &r.results {
        series
            .entry(row.policy.as_str())
            .or_default()
            .push((row.capacity_fraction * 100.0, 1.0 - row.hit_rate));
    }
    let x_max = r
        .results
        .iter()
        .map(|x| x.capacity_fraction * 100.0)
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.05;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("miss ratio, {} ({} rules)", r.trace, r.rules),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..x_max, 0f64..1.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("capacity, % of the trace's distinct blocks")
        .y_desc("miss ratio (1 - prefix hit rate)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, mut points)) in series.into_iter().enumerate() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
