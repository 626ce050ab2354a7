//! Logging: what goes to the terminal, and where the roles' logs go.
//!
//! - Query and data commands (`status`, `scale`, `kill`, `logs`, `data ...`) and `edl
//!   run`'s supervisor print warnings and errors only; `-v` shows debug, `-vv` trace.
//! - The long-running roles (`master`, `pserver`, `trainer`, `consume`) log INFO, to
//!   stderr (which `edl run` points at their log file).
//! - Roles that `edl run` runs in its own process (the in-memory mode) run inside a
//!   [`role_span`]: their events go to `RUN_DIR/logs/<role>.log` (INFO and up, like a
//!   child process's) and not to the terminal, which keeps the progress line, warnings
//!   and the summary. The directory is set with [`set_role_log_dir`].
//!
//! `EDL_LOG` (a tracing filter such as `info,edl_coord=debug`) overrides the level of
//! the terminal.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, PoisonError};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::{DynFilterFn, EnvFilter};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// The name of the span that marks a role run in process.
const ROLE_SPAN: &str = "edl_role";

/// How much a command says on the terminal by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verbosity {
    /// Warnings and errors (queries, data tools, `edl run`).
    Quiet,
    /// INFO and up (the long-running roles).
    Info,
}

/// Sets up `tracing`: the terminal (stderr) at the command's default level (raised by
/// `-v`, overridden by `EDL_LOG`), and per-role log files for roles run in process.
pub fn init(verbosity: Verbosity, verbose: u8) {
    let default = match (verbose, verbosity) {
        (0, Verbosity::Quiet) => "warn",
        (0, Verbosity::Info) => "info",
        (1, _) => "debug",
        _ => "trace",
    };
    let filter =
        EnvFilter::try_from_env(edl_job::env::LOG).unwrap_or_else(|_| EnvFilter::new(default));
    let terminal = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .with_filter(DynFilterFn::new(|_, cx| !in_role(cx.lookup_current())))
        .with_filter(filter);
    let _ = tracing_subscriber::registry()
        .with(terminal)
        .with(RoleFiles.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
        .try_init();
}

/// A span that sends the events of what runs inside it to `<dir>/<name>.log`. At
/// ERROR level so that every filter keeps it (it prints nothing itself).
pub fn role_span(name: &str) -> tracing::Span {
    tracing::error_span!(ROLE_SPAN, role = %name)
}

/// Where the log files of [`role_span`]s go (until then their events are dropped).
pub fn set_role_log_dir(dir: PathBuf) {
    let mut files = role_files().lock().unwrap_or_else(PoisonError::into_inner);
    files.dir = Some(dir);
    files.open.clear();
}

struct Files {
    dir: Option<PathBuf>,
    open: HashMap<String, File>,
}

fn role_files() -> &'static Mutex<Files> {
    static FILES: OnceLock<Mutex<Files>> = OnceLock::new();
    FILES.get_or_init(|| {
        Mutex::new(Files {
            dir: None,
            open: HashMap::new(),
        })
    })
}

fn in_role<S>(span: Option<tracing_subscriber::registry::SpanRef<'_, S>>) -> bool
where
    S: for<'a> LookupSpan<'a>,
{
    span.is_some_and(|s| s.scope().any(|s| s.name() == ROLE_SPAN))
}

/// The role name recorded on a [`role_span`].
struct RoleName(String);

struct RoleVisitor<'a>(&'a mut Option<String>);

impl Visit for RoleVisitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "role" {
            *self.0 = Some(format!("{value:?}"));
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "role" {
            *self.0 = Some(value.to_owned());
        }
    }
}

/// One log line: the message, then the other fields as `name=value`.
struct LineVisitor {
    message: String,
    fields: String,
}

impl Visit for LineVisitor {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }
}

/// The layer that writes the events of [`role_span`]s to their files.
struct RoleFiles;

impl<S> Layer<S> for RoleFiles
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        if attrs.metadata().name() != ROLE_SPAN {
            return;
        }
        let mut name = None;
        attrs.record(&mut RoleVisitor(&mut name));
        if let (Some(name), Some(span)) = (name, ctx.span(id)) {
            span.extensions_mut().insert(RoleName(name));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(scope) = ctx.event_scope(event) else {
            return;
        };
        let Some(role) = scope
            .into_iter()
            .find_map(|s| s.extensions().get::<RoleName>().map(|r| r.0.clone()))
        else {
            return;
        };
        let mut line = LineVisitor {
            message: String::new(),
            fields: String::new(),
        };
        event.record(&mut line);
        let meta = event.metadata();
        let level = match *meta.level() {
            Level::ERROR => "ERROR",
            Level::WARN => " WARN",
            Level::INFO => " INFO",
            Level::DEBUG => "DEBUG",
            Level::TRACE => "TRACE",
        };
        let text = format!(
            "{} {level} {}{}\n",
            humantime::format_rfc3339_micros(std::time::SystemTime::now()),
            line.message,
            line.fields
        );
        let mut files = role_files().lock().unwrap_or_else(PoisonError::into_inner);
        let Some(dir) = files.dir.clone() else {
            return;
        };
        if !files.open.contains_key(&role) {
            let path = dir.join(format!("{role}.log"));
            match OpenOptions::new().create(true).append(true).open(&path) {
                Ok(f) => {
                    files.open.insert(role.clone(), f);
                }
                Err(_) => return,
            }
        }
        if let Some(f) = files.open.get_mut(&role) {
            let _ = f.write_all(text.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_events_go_to_their_file_and_others_do_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let subscriber = tracing_subscriber::registry()
            .with(RoleFiles.with_filter(tracing_subscriber::filter::LevelFilter::INFO));
        set_role_log_dir(dir.path().to_owned());
        tracing::subscriber::with_default(subscriber, || {
            let _g = role_span("trainer-0").entered();
            tracing::info!(step = 3, "trained a batch");
            tracing::debug!("below the file level");
            drop(_g);
            tracing::info!("outside every role");
            let _g = role_span("master-0").entered();
            tracing::warn!("a master warning");
        });
        let trainer =
            std::fs::read_to_string(dir.path().join("trainer-0.log")).expect("trainer log");
        assert!(trainer.contains("INFO trained a batch step=3"), "{trainer}");
        assert!(!trainer.contains("below the file level"), "{trainer}");
        assert!(!trainer.contains("outside every role"), "{trainer}");
        let master = std::fs::read_to_string(dir.path().join("master-0.log")).expect("master log");
        assert!(master.contains("WARN a master warning"), "{master}");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("read dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
