//! The Learner components of ranks other than 0: they log, render and store nothing.
//!
//! burn-train's `SupervisedTraining::launch` writes into its directory unless told otherwise:
//! - a `FileMetricLogger` when no metric logger was registered → [`NoMetricLogger`];
//! - `experiment.log`, through the default application logger → `with_application_logger(None)`;
//! - checkpoints, through the recorder given to `with_file_checkpointer` → [`super::RankZeroRecorder`]
//!   writes nothing on these ranks;
//! - a summary, only if `summary()` was called.
//!
//! and prints every item through its default renderer → [`SilentRenderer`].

use burn_train::logger::MetricLogger;
use burn_train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn_train::metric::{MetricDefinition, NumericEntry};
use burn_train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// A metric logger that keeps nothing. Reading gives no points, which burn-train treats as
/// "no value": these ranks' checkpointing strategies only decide deletions in their own empty
/// directory, and early stopping follows rank 0's decision ([`super::AgreedEarlyStopping`]).
pub struct NoMetricLogger;

impl MetricLogger for NoMetricLogger {
    fn log(&mut self, _update: MetricsUpdate, _epoch: usize, _split: &Split) {}

    fn read_numeric(
        &mut self,
        _name: &str,
        _epoch: usize,
        _split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        Ok(Vec::new())
    }

    fn log_metric_definition(&mut self, _definition: MetricDefinition) {}

    fn log_epoch_summary(&mut self, _summary: EpochSummary) {}
}

/// A renderer that shows nothing.
pub struct SilentRenderer;

impl MetricsRendererTraining for SilentRenderer {
    fn update_train(&mut self, _state: MetricState) {}

    fn update_valid(&mut self, _state: MetricState) {}

    fn render_train(&mut self, _item: TrainingProgress, _indicators: Vec<ProgressType>) {}

    fn render_valid(&mut self, _item: TrainingProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for SilentRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}

    fn render_test(&mut self, _item: EvaluationProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRenderer for SilentRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, _definition: MetricDefinition) {}
}
