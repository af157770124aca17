//! Logging, NCCL-style: WARN, INFO or TRACE lines to stderr or to QCCL_DEBUG_FILE
//! (QCCL_DEBUG), filtered by subsystem (QCCL_DEBUG_SUBSYS); with the `log` feature, every
//! message also goes to the `log` facade, so an embedding program's logger sees it.
//!
//! A line reads `host:pid:tid QCCL INFO NET rank 0: comm ...`: NCCL's `host:pid:tid`, the
//! level, then the message's subsystem. Call sites write `qlog!(Info, "...", args)`; the
//! subsystem comes from the caller's module path ([`tag_of`], [`TABLE`]), worked out at
//! compile time.
//!
//! QCCL_DEBUG_SUBSYS follows NCCL_DEBUG_SUBSYS: a comma list of subsystem names (any case),
//! `ALL` for every one; a leading `^` inverts the whole list (`^COLL,NET`: all but COLL and
//! NET); the default is NCCL's, `INIT,BOOTSTRAP,ENV`. Unknown names are ignored, with one WARN.
//! WARN lines pass any filter that lets anything through (NCCL's WARN carries every
//! subsystem). The transports' lines count as INIT as well as NET, SHM or P2P, as NCCL's
//! connection lines (INIT|NET) do, so the default still shows which transport each peer got.
//!
//! The two sinks are independent. QCCL_DEBUG and QCCL_DEBUG_SUBSYS govern qccl's own sink
//! only. With the `log` feature, the facade gets every message its logger enables (target
//! `qccl::<subsystem>` in lower case, e.g. `qccl::net`; the record's module path, file and
//! line are the call site's; WARN, INFO, TRACE map to `warn`, `info`, `trace`), whatever
//! QCCL_DEBUG says: leave QCCL_DEBUG unset not to print a message twice. When neither sink
//! wants a message, its arguments are not formatted.

use std::cell::Cell;
use std::fs::File;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

/// Verbosity, from QCCL_DEBUG (unset or anything else: nothing, as NCCL).
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

/// A subsystem, as NCCL_DEBUG_SUBSYS names them; CODEC and PLAN are qccl's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subsys {
    /// Comm creation, split, shrink, launch: NCCL's INIT.
    Init,
    /// Collectives: algorithms, routes, the op queue.
    Coll,
    /// The in-process (threads) transport.
    P2p,
    /// The shared-memory transport.
    Shm,
    /// TCP: connections, sockets.
    Net,
    /// Variables read from the environment.
    Env,
    /// Unique id, root rendezvous, launcher variables, interfaces.
    Bootstrap,
    /// The stall inspector: who stalled a timed-out collective.
    Ras,
    /// Codecs and error feedback.
    Codec,
    /// Fusion plans and their runners.
    Plan,
}

impl Subsys {
    /// Every subsystem, in bit order.
    pub const ALL: [Subsys; 10] = [
        Subsys::Init,
        Subsys::Coll,
        Subsys::P2p,
        Subsys::Shm,
        Subsys::Net,
        Subsys::Env,
        Subsys::Bootstrap,
        Subsys::Ras,
        Subsys::Codec,
        Subsys::Plan,
    ];

    /// This subsystem's bit in a QCCL_DEBUG_SUBSYS mask.
    pub const fn bit(self) -> u32 {
        1 << self as u32
    }

    /// The name printed and accepted by QCCL_DEBUG_SUBSYS.
    pub const fn name(self) -> &'static str {
        match self {
            Subsys::Init => "INIT",
            Subsys::Coll => "COLL",
            Subsys::P2p => "P2P",
            Subsys::Shm => "SHM",
            Subsys::Net => "NET",
            Subsys::Env => "ENV",
            Subsys::Bootstrap => "BOOTSTRAP",
            Subsys::Ras => "RAS",
            Subsys::Codec => "CODEC",
            Subsys::Plan => "PLAN",
        }
    }

    /// The `log` facade's target for this subsystem's messages.
    pub const fn target(self) -> &'static str {
        match self {
            Subsys::Init => "qccl::init",
            Subsys::Coll => "qccl::coll",
            Subsys::P2p => "qccl::p2p",
            Subsys::Shm => "qccl::shm",
            Subsys::Net => "qccl::net",
            Subsys::Env => "qccl::env",
            Subsys::Bootstrap => "qccl::bootstrap",
            Subsys::Ras => "qccl::ras",
            Subsys::Codec => "qccl::codec",
            Subsys::Plan => "qccl::plan",
        }
    }
}

/// Every subsystem's bit.
pub const ALL: u32 = (1 << Subsys::ALL.len()) - 1;

/// QCCL_DEBUG_SUBSYS unset: NCCL's default, INIT,BOOTSTRAP,ENV.
pub const DEFAULT_MASK: u32 = Subsys::Init.bit() | Subsys::Bootstrap.bit() | Subsys::Env.bit();

/// A message's subsystem, and whether it counts as INIT too (the transports' lines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// The subsystem printed and used as the facade's target.
    pub subsys: Subsys,
    /// Also shown when INIT is selected.
    pub init: bool,
}

impl Tag {
    const fn of(subsys: Subsys) -> Tag {
        Tag {
            subsys,
            init: false,
        }
    }

    const fn setup(subsys: Subsys) -> Tag {
        Tag { subsys, init: true }
    }

    /// The QCCL_DEBUG_SUBSYS bits that show this tag's INFO and TRACE lines.
    pub const fn mask(self) -> u32 {
        self.subsys.bit() | if self.init { Subsys::Init.bit() } else { 0 }
    }
}

/// Module paths under `qccl::` and their subsystems, first match wins (a prefix matches the
/// module and those below it). Modules in none: INIT.
pub const TABLE: &[(&str, Tag)] = &[
    ("bootstrap", Tag::of(Subsys::Bootstrap)),
    ("config", Tag::of(Subsys::Env)),
    ("log", Tag::of(Subsys::Env)),
    ("launch", Tag::of(Subsys::Init)),
    // Per-call paths of the comm; the rest (init, split, shrink, hier's sub-comms) is INIT.
    ("comm::api", Tag::of(Subsys::Coll)),
    ("comm::compress", Tag::of(Subsys::Coll)),
    ("comm::hitopk", Tag::of(Subsys::Coll)),
    ("comm::pipeline", Tag::of(Subsys::Coll)),
    ("comm::queue", Tag::of(Subsys::Coll)),
    ("comm::route", Tag::of(Subsys::Coll)),
    ("comm", Tag::of(Subsys::Init)),
    ("coll", Tag::of(Subsys::Coll)),
    ("algo", Tag::of(Subsys::Coll)),
    ("reduce", Tag::of(Subsys::Coll)),
    ("codec", Tag::of(Subsys::Codec)),
    ("fused", Tag::of(Subsys::Plan)),
    ("transport::stall", Tag::of(Subsys::Ras)),
    ("transport::endpoint", Tag::setup(Subsys::Net)),
    ("transport::net", Tag::setup(Subsys::Net)),
    ("transport::socket", Tag::setup(Subsys::Net)),
    ("transport::shm", Tag::setup(Subsys::Shm)),
    ("transport::inproc", Tag::setup(Subsys::P2p)),
    ("transport", Tag::of(Subsys::Net)),
];

/// The tag of a message logged from `module_path` (a `module_path!()`), by [`TABLE`].
pub const fn tag_of(module_path: &str) -> Tag {
    const FALLBACK: Tag = Tag::of(Subsys::Init);
    let p = module_path.as_bytes();
    if !is_under(p, 0, b"qccl") || p.len() == 4 {
        return FALLBACK;
    }
    let mut i = 0;
    while i < TABLE.len() {
        if is_under(p, 6, TABLE[i].0.as_bytes()) {
            return TABLE[i].1;
        }
        i += 1;
    }
    FALLBACK
}

/// True when `path[start..]` is the module `prefix` or one below it.
const fn is_under(path: &[u8], start: usize, prefix: &[u8]) -> bool {
    let end = start + prefix.len();
    if path.len() < end {
        return false;
    }
    let mut i = 0;
    while i < prefix.len() {
        if path[start + i] != prefix[i] {
            return false;
        }
        i += 1;
    }
    path.len() == end || (path.len() > end + 1 && path[end] == b':' && path[end + 1] == b':')
}

/// Parses QCCL_DEBUG_SUBSYS as NCCL parses NCCL_DEBUG_SUBSYS: the mask, and the names it
/// did not know (ignored).
pub fn parse_subsys(value: &str) -> (u32, Vec<String>) {
    let value = value.trim();
    let (invert, list) = match value.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let mut mask = if invert { ALL } else { 0 };
    let mut unknown = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let bits = if name.eq_ignore_ascii_case("ALL") {
            Some(ALL)
        } else {
            Subsys::ALL
                .iter()
                .find(|s| s.name().eq_ignore_ascii_case(name))
                .map(|s| s.bit())
        };
        match bits {
            Some(b) if invert => mask &= !b,
            Some(b) => mask |= b,
            None => unknown.push(name.to_string()),
        }
    }
    (mask, unknown)
}

/// QCCL_DEBUG's value as a level.
pub fn parse_level(value: &str) -> Level {
    match value.trim().to_ascii_uppercase().as_str() {
        "WARN" => Level::Warn,
        "INFO" => Level::Info,
        "TRACE" => Level::Trace,
        _ => Level::None,
    }
}

/// Where a `qlog!` is: its tag and, for the facade, its module path, file and line.
#[derive(Debug)]
pub struct Site {
    /// The message's subsystem.
    pub tag: Tag,
    /// `module_path!()` of the call.
    pub module_path: &'static str,
    /// `file!()` of the call.
    pub file: &'static str,
    /// `line!()` of the call.
    pub line: u32,
}

impl Site {
    /// The site of a call in `module_path`, at `file`:`line`.
    pub const fn new(module_path: &'static str, file: &'static str, line: u32) -> Site {
        Site {
            tag: tag_of(module_path),
            module_path,
            file,
            line,
        }
    }
}

/// qccl's own sink: QCCL_DEBUG, QCCL_DEBUG_SUBSYS, QCCL_DEBUG_FILE.
struct Sink {
    level: Level,
    mask: u32,
    file: Option<Mutex<File>>,
    prefix: String,
}

impl Sink {
    fn wants(&self, level: Level, tag: Tag) -> bool {
        let shows = if level == Level::Warn {
            ALL
        } else {
            tag.mask()
        };
        level != Level::None && level <= self.level && shows & self.mask != 0
    }

    fn print(&self, level: Level, tag: Tag, msg: std::fmt::Arguments<'_>) {
        let line = format!(
            "{}:{} QCCL {} {} {msg}\n",
            self.prefix,
            tid(),
            level_name(level),
            tag.subsys.name()
        );
        match &self.file {
            Some(f) => {
                let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
                let _ = f.write_all(line.as_bytes());
            }
            None => {
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
        }
    }
}

fn level_name(level: Level) -> &'static str {
    match level {
        Level::Warn => "WARN",
        Level::Info => "INFO",
        _ => "TRACE",
    }
}

/// This thread's kernel id (NCCL's `tid`).
fn tid() -> i32 {
    thread_local!(static TID: Cell<i32> = const { Cell::new(0) });
    TID.with(|t| {
        if t.get() == 0 {
            t.set(nix::unistd::gettid().as_raw());
        }
        t.get()
    })
}

fn sink() -> &'static Sink {
    static SINK: OnceLock<Sink> = OnceLock::new();
    SINK.get_or_init(|| {
        let level = parse_level(&std::env::var("QCCL_DEBUG").unwrap_or_default());
        let (mask, unknown) = match std::env::var("QCCL_DEBUG_SUBSYS") {
            Ok(v) if !v.trim().is_empty() => parse_subsys(&v),
            _ => (DEFAULT_MASK, Vec::new()),
        };
        let host = crate::sys::hostname();
        let pid = std::process::id();
        let file = std::env::var("QCCL_DEBUG_FILE").ok().and_then(|pattern| {
            let path = pattern.replace("%h", &host).replace("%p", &pid.to_string());
            File::create(&path).ok().map(Mutex::new)
        });
        let s = Sink {
            level,
            mask,
            file,
            prefix: format!("{host}:{pid}"),
        };
        if !unknown.is_empty() {
            // Not through `write`: that would ask for this sink while it is being made.
            static SITE: Site = Site::new(module_path!(), file!(), line!());
            let known: Vec<&str> = Subsys::ALL.iter().map(|s| s.name()).collect();
            let known = known.join(",");
            let msg =
                format_args!("QCCL_DEBUG_SUBSYS: unknown {unknown:?} ignored (known: {known},ALL)");
            if s.wants(Level::Warn, SITE.tag) {
                s.print(Level::Warn, SITE.tag, msg);
            }
            facade::log(Level::Warn, &SITE, msg);
        }
        s
    })
}

/// True when a sink wants messages at `level` from `site` (callers use `qlog!`).
#[inline]
pub fn enabled(level: Level, site: &Site) -> bool {
    sink().wants(level, site.tag) || facade::enabled(level, site)
}

/// Sends one message to the sinks that want it (callers use `qlog!`).
pub fn write(level: Level, site: &Site, msg: std::fmt::Arguments<'_>) {
    let s = sink();
    if s.wants(level, site.tag) {
        s.print(level, site.tag, msg);
    }
    facade::log(level, site, msg);
}

/// The `log` facade, with the `log` feature.
#[cfg(feature = "log")]
mod facade {
    use super::{Level, Site};

    fn level(level: Level) -> Option<::log::Level> {
        match level {
            Level::None => None,
            Level::Warn => Some(::log::Level::Warn),
            Level::Info => Some(::log::Level::Info),
            Level::Trace => Some(::log::Level::Trace),
        }
    }

    #[inline]
    pub(super) fn enabled(l: Level, site: &Site) -> bool {
        level(l).is_some_and(|l| ::log::log_enabled!(target: site.tag.subsys.target(), l))
    }

    pub(super) fn log(l: Level, site: &Site, msg: std::fmt::Arguments<'_>) {
        let Some(l) = level(l) else { return };
        let target = site.tag.subsys.target();
        if !::log::log_enabled!(target: target, l) {
            return;
        }
        ::log::logger().log(
            &::log::Record::builder()
                .args(msg)
                .level(l)
                .target(target)
                .module_path_static(Some(site.module_path))
                .file_static(Some(site.file))
                .line(Some(site.line))
                .build(),
        );
    }
}

/// Without the `log` feature: no facade.
#[cfg(not(feature = "log"))]
mod facade {
    use super::{Level, Site};

    #[inline]
    pub(super) fn enabled(_: Level, _: &Site) -> bool {
        false
    }

    #[inline]
    pub(super) fn log(_: Level, _: &Site, _: std::fmt::Arguments<'_>) {}
}

/// `qlog!(Info, "fmt", args..)` logs at a level named (Warn, Info, Trace);
/// `qlog!(level = expr, "fmt", args..)` at a [`Level`] known at run time. The subsystem comes
/// from the caller's module path; the arguments are formatted only when a sink wants them.
#[doc(hidden)]
#[macro_export]
macro_rules! qlog {
    (level = $lvl:expr, $($arg:tt)*) => {{
        static SITE: $crate::log::Site = $crate::log::Site::new(module_path!(), file!(), line!());
        let level: $crate::log::Level = $lvl;
        if $crate::log::enabled(level, &SITE) {
            $crate::log::write(level, &SITE, format_args!($($arg)*));
        }
    }};
    ($lvl:ident, $($arg:tt)*) => {
        $crate::qlog!(level = $crate::log::Level::$lvl, $($arg)*)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(path: &str) -> (&'static str, bool) {
        let t = tag_of(path);
        (t.subsys.name(), t.init)
    }

    #[test]
    fn module_paths_map_to_subsystems() {
        for (path, want) in [
            ("qccl::bootstrap", ("BOOTSTRAP", false)),
            ("qccl::bootstrap::root", ("BOOTSTRAP", false)),
            ("qccl::bootstrap::env", ("BOOTSTRAP", false)),
            ("qccl::config", ("ENV", false)),
            ("qccl::log", ("ENV", false)),
            ("qccl::launch", ("INIT", false)),
            ("qccl::comm", ("INIT", false)),
            ("qccl::comm::shrink", ("INIT", false)),
            ("qccl::comm::hier", ("INIT", false)),
            ("qccl::comm::route", ("COLL", false)),
            ("qccl::comm::queue", ("COLL", false)),
            ("qccl::algo::compressed::ring", ("COLL", false)),
            ("qccl::coll", ("COLL", false)),
            ("qccl::codec::ef", ("CODEC", false)),
            ("qccl::fused::buckets", ("PLAN", false)),
            ("qccl::transport::net", ("NET", true)),
            ("qccl::transport::net::acceptor", ("NET", true)),
            ("qccl::transport::socket", ("NET", true)),
            ("qccl::transport::endpoint", ("NET", true)),
            ("qccl::transport::engine", ("NET", false)),
            ("qccl::transport::shm::segment", ("SHM", true)),
            ("qccl::transport::inproc", ("P2P", true)),
            ("qccl::transport::stall", ("RAS", false)),
            ("qccl::transport::wait", ("NET", false)),
            // Whole names only, the crate root, other crates: INIT.
            ("qccl::logger", ("INIT", false)),
            ("qccl::transport::netx", ("NET", false)),
            ("qccl", ("INIT", false)),
            ("qcclx::config", ("INIT", false)),
            ("qccl_ffi::config", ("INIT", false)),
        ] {
            assert_eq!(tag(path), want, "{path}");
        }
        // Every row is reachable: no earlier prefix hides it.
        for (i, (prefix, t)) in TABLE.iter().enumerate() {
            let path = format!("qccl::{prefix}");
            assert_eq!(tag_of(&path), *t, "row {i}: {prefix}");
        }
        // The macro works the tag out at compile time, from the caller's module.
        const HERE: Site = Site::new(module_path!(), file!(), line!());
        assert_eq!(HERE.tag, Tag::of(Subsys::Env));
    }

    #[test]
    fn names_bits_and_targets_are_distinct() {
        let mut bits = 0;
        for s in Subsys::ALL {
            assert_eq!(bits & s.bit(), 0, "{s:?}");
            bits |= s.bit();
            assert_eq!(s.target(), format!("qccl::{}", s.name().to_lowercase()));
        }
        assert_eq!(bits, ALL);
    }

    #[test]
    fn subsys_lists_parse_as_nccl_does() {
        let b = |names: &[Subsys]| names.iter().fold(0, |m, s| m | s.bit());
        use Subsys::*;
        assert_eq!(parse_subsys("INIT"), (b(&[Init]), vec![]));
        assert_eq!(
            parse_subsys("net, Coll ,shm"),
            (b(&[Net, Coll, Shm]), vec![])
        );
        assert_eq!(parse_subsys("ALL"), (ALL, vec![]));
        assert_eq!(parse_subsys("all,INIT"), (ALL, vec![]));
        // A leading ^ inverts the whole list.
        assert_eq!(parse_subsys("^COLL"), (ALL & !b(&[Coll]), vec![]));
        assert_eq!(parse_subsys("^COLL,NET"), (ALL & !b(&[Coll, Net]), vec![]));
        assert_eq!(parse_subsys("^ALL"), (0, vec![]));
        assert_eq!(parse_subsys("^"), (ALL, vec![]));
        // Unknown names (NCCL's GRAPH, a ^ inside the list) are ignored and reported.
        assert_eq!(
            parse_subsys("INIT,GRAPH,^NET"),
            (b(&[Init]), vec!["GRAPH".to_string(), "^NET".to_string()])
        );
        assert_eq!(parse_subsys(",,"), (0, vec![]));
        assert_eq!(DEFAULT_MASK, b(&[Init, Bootstrap, Env]));
    }

    #[test]
    fn sink_filters_by_level_and_subsystem() {
        let sink = |level, mask| Sink {
            level,
            mask,
            file: None,
            prefix: String::new(),
        };
        let net = tag_of("qccl::transport::net");
        let coll = tag_of("qccl::comm::route");
        let s = sink(Level::Info, DEFAULT_MASK);
        assert!(s.wants(Level::Warn, coll));
        assert!(s.wants(Level::Info, net), "transport lines count as INIT");
        assert!(!s.wants(Level::Info, coll));
        assert!(!s.wants(Level::Trace, net));
        assert!(!s.wants(Level::None, net));
        let s = sink(Level::Trace, parse_subsys("COLL").0);
        assert!(s.wants(Level::Trace, coll));
        assert!(!s.wants(Level::Info, net));
        assert!(s.wants(Level::Warn, net), "WARN passes any filter");
        let s = sink(Level::Trace, parse_subsys("^INIT").0);
        assert!(s.wants(Level::Info, net), "NET is still selected");
        assert!(!s.wants(Level::Info, tag_of("qccl::comm")));
        let s = sink(Level::Trace, 0);
        assert!(!s.wants(Level::Warn, net));
        assert!(!sink(Level::None, ALL).wants(Level::Warn, net));
        assert_eq!(parse_level(" trace"), Level::Trace);
        assert_eq!(parse_level("VERSION"), Level::None);
    }

    /// With the `log` feature: a logger of the embedding program gets the messages, with
    /// the subsystem's target and the call site's module path.
    #[cfg(feature = "log")]
    #[test]
    fn the_log_facade_gets_messages() {
        use std::fmt;
        use std::sync::atomic::{AtomicUsize, Ordering};

        type Seen = (String, ::log::Level, Option<String>, String);
        struct Capture(Mutex<Vec<Seen>>);
        impl ::log::Log for Capture {
            fn enabled(&self, m: &::log::Metadata<'_>) -> bool {
                m.level() <= ::log::Level::Info
            }
            fn log(&self, r: &::log::Record<'_>) {
                if self.enabled(r.metadata()) {
                    let seen = (
                        r.target().to_string(),
                        r.level(),
                        r.module_path().map(str::to_string),
                        r.args().to_string(),
                    );
                    self.0.lock().unwrap().push(seen);
                }
            }
            fn flush(&self) {}
        }
        static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));
        ::log::set_logger(&CAPTURE).expect("no other logger in this test binary");
        ::log::set_max_level(::log::LevelFilter::Trace);

        crate::qlog!(Info, "facade test {}", 42);
        crate::qlog!(Warn, "facade test warn");
        let seen = CAPTURE.0.lock().unwrap().clone();
        let mine: Vec<&Seen> = seen
            .iter()
            .filter(|s| s.3.starts_with("facade test"))
            .collect();
        let here = Some(module_path!().to_string());
        let s = |t: &str, l, m: &Option<String>, a: &str| -> Seen {
            (t.into(), l, m.clone(), a.into())
        };
        assert_eq!(
            mine,
            [
                &s("qccl::env", ::log::Level::Info, &here, "facade test 42"),
                &s("qccl::env", ::log::Level::Warn, &here, "facade test warn"),
            ]
        );

        // Neither sink wants TRACE (unless QCCL_DEBUG says so): nothing is formatted.
        struct Counted<'a>(&'a AtomicUsize);
        impl fmt::Display for Counted<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fetch_add(1, Ordering::Relaxed);
                f.write_str("counted")
            }
        }
        if !sink().wants(Level::Trace, tag_of(module_path!())) {
            let n = AtomicUsize::new(0);
            crate::qlog!(Trace, "facade test {}", Counted(&n));
            assert_eq!(n.load(Ordering::Relaxed), 0);
            crate::qlog!(Info, "facade test {}", Counted(&n));
            assert_eq!(n.load(Ordering::Relaxed), 1);
        }
    }
}
