//! The bottom layer: what every layer uses to show its work to the operator, the metric names
//! and their recording, and durations in the Go syntax log lines and flags use.

pub mod duration;
pub mod telemetry;
