//! The end-of-run figure: training and validation loss (with the entropy floor when known)
//! and throughput against the step, as one SVG.

use std::path::Path;

use plotters::prelude::*;

use crate::metrics::StepRecord;

/// Writes the figure of `records` to `out`.
pub fn plot(records: &[StepRecord], floor: Option<f64>, out: &Path) -> Result<(), String> {
    if records.is_empty() {
        return Ok(());
    }
    let fail = |e: &dyn std::fmt::Display| format!("plotting {}: {e}", out.display());
    let root = SVGBackend::new(out, (900, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let (top, bottom) = root.split_vertically(430);
    let last = records.last().map_or(1, |r| r.step) as f64;

    // Loss: from the floor (or the lowest loss) to the highest loss seen.
    let val: Vec<(f64, f64)> = records
        .iter()
        .filter_map(|r| r.val_loss.map(|v| (r.step as f64, v)))
        .collect();
    let train: Vec<(f64, f64)> = records.iter().map(|r| (r.step as f64, r.loss)).collect();
    let losses = train.iter().chain(&val).map(|p| p.1).chain(floor);
    let (low, high) = losses.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let pad = 0.05 * (high - low).max(1e-3);
    let mut chart = ChartBuilder::on(&top)
        .caption("loss (nats/token)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..last, (low - pad)..(high + pad))
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .draw()
        .map_err(|e| fail(&e))?;
    chart
        .draw_series(LineSeries::new(train, &BLUE))
        .map_err(|e| fail(&e))?
        .label("train")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLUE));
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val, &RED))
            .map_err(|e| fail(&e))?
            .label("validation")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RED));
    }
    if let Some(floor) = floor {
        chart
            .draw_series(LineSeries::new([(0.0, floor), (last, floor)], &BLACK))
            .map_err(|e| fail(&e))?
            .label("entropy floor")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;

    // Throughput (the first step includes warm-up and is left out of the scale).
    let speed: Vec<(f64, f64)> = records
        .iter()
        .map(|r| (r.step as f64, r.tokens_per_s))
        .collect();
    let top_speed = speed.iter().skip(1).map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&bottom)
        .caption("throughput (tokens/s, all ranks)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..last, 0.0..top_speed)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .draw()
        .map_err(|e| fail(&e))?;
    chart
        .draw_series(LineSeries::new(speed, &GREEN))
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))
}
