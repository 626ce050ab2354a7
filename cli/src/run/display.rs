//! The live progress display (a spinner with a message on a terminal; a log line every
//! few seconds otherwise).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use edl_proto::master::StatusResponse;

use super::report::Recovery;

/// The progress display of a run.
pub(crate) struct Display {
    bar: Option<indicatif::ProgressBar>,
    last_line: Instant,
    last_records: (Instant, u64),
    rate: f64,
}

impl Display {
    pub(crate) fn new(quiet: bool) -> Display {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new(0);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tasks  {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        Display {
            bar,
            last_line: Instant::now() - Duration::from_secs(60),
            last_records: (Instant::now(), 0),
            rate: 0.0,
        }
    }

    pub(crate) fn update(
        &mut self,
        status: Option<&StatusResponse>,
        trainers: usize,
        restarts: u32,
        recoveries: &[Recovery],
    ) {
        let Some(s) = status else {
            if let Some(b) = &self.bar {
                b.set_message("waiting for the master");
            }
            return;
        };
        let records = s.counters.map_or(0, |c| c.records_trained);
        let dt = self.last_records.0.elapsed().as_secs_f64();
        if dt >= 1.0 {
            self.rate = (records.saturating_sub(self.last_records.1)) as f64 / dt;
            self.last_records = (Instant::now(), records);
        }
        let total = s.todo + s.pending + s.done + s.failed;
        let msg = format!(
            "pass {}/{}  {:.0} samples/s  trainers {}  recoveries {}  restarts {}",
            s.pass + 1,
            s.passes.max(1),
            self.rate,
            trainers,
            recoveries.len(),
            restarts
        );
        match &self.bar {
            Some(b) => {
                b.set_length(total);
                b.set_position(s.done);
                b.set_message(msg);
            }
            None => {
                if self.last_line.elapsed() >= Duration::from_secs(2) {
                    self.last_line = Instant::now();
                    println!("[edl run] tasks {}/{}  {msg}", s.done, total);
                }
            }
        }
    }

    pub(crate) fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}
