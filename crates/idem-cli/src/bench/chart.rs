//! The SVG chart of `idem bench --svg`: ops/s per engine and path, drawn with plotters
//! from the reports of this run and of `--with` files. One panel per engine (each with
//! its own scale: SQLite's in-process figures are many times the server engines'), one
//! bar per client count in every path's group.

use std::path::Path as FsPath;

use plotters::prelude::*;

use super::{Path, Report};
use crate::fail::Fail;

const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

fn failed(e: impl std::fmt::Display) -> Fail {
    Fail::new(1, format!("cannot draw the chart: {e}"))
}

pub(super) fn draw(reports: &[Report], file: &FsPath) -> Result<(), Fail> {
    let reports: Vec<&Report> = reports.iter().filter(|r| !r.cells.is_empty()).collect();
    if reports.is_empty() {
        return Err(Fail::new(
            crate::fail::INVALID_INPUT,
            "no path measurements to chart (a --growth report has none)",
        ));
    }
    let mut clients: Vec<usize> = reports
        .iter()
        .flat_map(|r| r.cells.iter().map(|c| c.clients))
        .collect();
    clients.sort_unstable();
    clients.dedup();
    let paths = Path::ALL;
    // One slot per client count plus a gap, per path.
    let slots = clients.len() + 1;
    let height = 340 * u32::try_from(reports.len()).unwrap_or(1);
    let root = SVGBackend::new(file, (1100, height)).into_drawing_area();
    root.fill(&WHITE).map_err(failed)?;
    let panels = root.split_evenly((reports.len(), 1));
    for (panel, report) in panels.iter().zip(&reports) {
        let max = report
            .cells
            .iter()
            .map(|c| c.ops_per_s)
            .fold(1.0_f64, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!(
                    "{}: operations per second by path (higher is better)",
                    report.server
                ),
                ("sans-serif", 17),
            )
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d((0..paths.len() * slots).into_segmented(), 0.0..max * 1.3)
            .map_err(failed)?;
        let middle = clients.len() / 2;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .x_labels(paths.len() * slots)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) if i % slots == middle && i / slots < paths.len() => {
                    format!(
                        "({}) {}",
                        paths[i / slots].letter(),
                        paths[i / slots].short()
                    )
                }
                _ => String::new(),
            })
            .y_label_formatter(&|v| format!("{v:.0}"))
            .y_desc("ops/s")
            .draw()
            .map_err(failed)?;
        for (k, &n) in clients.iter().enumerate() {
            let color = COLORS[k % COLORS.len()];
            let bars = paths.iter().enumerate().filter_map(|(i, p)| {
                let cell = report
                    .cells
                    .iter()
                    .find(|c| c.clients == n && c.path == *p)?;
                let slot = i * slots + k;
                Some(Rectangle::new(
                    [
                        (SegmentValue::Exact(slot), 0.0),
                        (SegmentValue::Exact(slot + 1), cell.ops_per_s),
                    ],
                    color.filled(),
                ))
            });
            chart
                .draw_series(bars)
                .map_err(failed)?
                .label(format!("{n} client(s)"))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(failed)?;
    }
    root.present().map_err(failed)?;
    Ok(())
}
