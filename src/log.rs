//! QCCL_DEBUG logging: WARN, INFO or TRACE lines to stderr or to QCCL_DEBUG_FILE, NCCL-style.

use std::fs::File;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

/// Verbosity, from QCCL_DEBUG (unset: warnings are still printed? no: NCCL prints nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Nothing is printed.
    None = 0,
    /// Errors and suspicious situations.
    Warn = 1,
    /// Setup decisions: variables, transports, algorithms.
    Info = 2,
    /// Every operation.
    Trace = 3,
}

struct Sink {
    level: Level,
    file: Option<Mutex<File>>,
    prefix: String,
}

fn sink() -> &'static Sink {
    static SINK: OnceLock<Sink> = OnceLock::new();
    SINK.get_or_init(|| {
        let level = match std::env::var("QCCL_DEBUG")
            .unwrap_or_default()
            .to_ascii_uppercase()
            .as_str()
        {
            "WARN" => Level::Warn,
            "INFO" => Level::Info,
            "TRACE" => Level::Trace,
            _ => Level::None,
        };
        let host = crate::sys::hostname();
        let pid = std::process::id();
        let file = std::env::var("QCCL_DEBUG_FILE").ok().and_then(|pattern| {
            let path = pattern.replace("%h", &host).replace("%p", &pid.to_string());
            File::create(&path).ok().map(Mutex::new)
        });
        Sink {
            level,
            file,
            prefix: format!("{host}:{pid}"),
        }
    })
}

/// True when messages at `level` are printed.
pub fn enabled(level: Level) -> bool {
    level != Level::None && level <= sink().level
}

/// Prints one line at `level` (callers use the `qlog!` macro).
pub fn write(level: Level, msg: std::fmt::Arguments<'_>) {
    let s = sink();
    let tag = match level {
        Level::Warn => "WARN",
        Level::Info => "INFO",
        _ => "TRACE",
    };
    let line = format!("{} QCCL {tag} {msg}\n", s.prefix);
    match &s.file {
        Some(f) => {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            let _ = f.write_all(line.as_bytes());
        }
        None => {
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }
}

/// `qlog!(Info, "fmt", args..)` prints when QCCL_DEBUG allows that level.
#[macro_export]
macro_rules! qlog {
    ($lvl:ident, $($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::$lvl) {
            $crate::log::write($crate::log::Level::$lvl, format_args!($($arg)*));
        }
    };
}
