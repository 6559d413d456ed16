//! Criterion benchmarks live beside this file; see docs/perf/.
