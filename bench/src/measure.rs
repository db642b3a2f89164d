//! Timing one cell of the matrix: latencies, percentiles, medians across rounds.

use std::time::{Duration, Instant};

/// How long to spend on one (system, size, round) cell, and its iteration bounds.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub time: Duration,
    pub min_iters: usize,
    pub max_iters: usize,
}

impl Budget {
    /// Warm-up iterations before timing: enough to fault in buffers and settle the spin.
    pub fn warmup(&self, size: usize) -> usize {
        if size >= 16 << 20 {
            2
        } else {
            (self.max_iters / 20).clamp(2, 2000)
        }
    }
}

/// The result of one cell.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub p50_us: f64,
    pub p99_us: f64,
    pub rps: f64,
}

/// Runs `op` (one timed operation) under `budget` and summarises the latencies.
pub fn run(budget: Budget, size: usize, mut op: impl FnMut()) -> Sample {
    for _ in 0..budget.warmup(size) {
        op();
    }
    let mut lat = Vec::with_capacity(budget.max_iters.min(1 << 20));
    let start = Instant::now();
    while lat.len() < budget.max_iters && (lat.len() < budget.min_iters || start.elapsed() < budget.time) {
        let t = Instant::now();
        op();
        lat.push(t.elapsed());
    }
    let total = start.elapsed();
    let n = lat.len();
    summarise(&mut lat, n, total)
}

/// [`run`] for an async operation, awaited in the calling task: a client that lives in a
/// tokio task, as an async application's code does, instead of a thread blocking on the runtime.
pub async fn run_async<F: std::future::Future<Output = ()>>(
    budget: Budget,
    size: usize,
    mut op: impl FnMut() -> F,
) -> Sample {
    for _ in 0..budget.warmup(size) {
        op().await;
    }
    let mut lat = Vec::with_capacity(budget.max_iters.min(1 << 20));
    let start = Instant::now();
    while lat.len() < budget.max_iters && (lat.len() < budget.min_iters || start.elapsed() < budget.time) {
        let t = Instant::now();
        op().await;
        lat.push(t.elapsed());
    }
    let total = start.elapsed();
    let n = lat.len();
    summarise(&mut lat, n, total)
}

/// p50/p99 of `lat`, and `ops` operations over `total` as a rate.
pub fn summarise(lat: &mut [Duration], ops: usize, total: Duration) -> Sample {
    lat.sort_unstable();
    let pick = |q: f64| {
        let i = ((lat.len() as f64 * q).ceil() as usize).clamp(1, lat.len().max(1)) - 1;
        lat.get(i).map_or(f64::NAN, |d| d.as_secs_f64() * 1e6)
    };
    Sample { p50_us: pick(0.50), p99_us: pick(0.99), rps: ops as f64 / total.as_secs_f64() }
}

/// Median of a few values (the middle one; mean of the middle two for an even count).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
