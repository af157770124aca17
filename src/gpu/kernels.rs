//! The CUDA sources of `kernels/`, embedded in the library (build.rs lists the folder, so a new
//! file is embedded without an edit here), and the entry points each exports.
//!
//! Entry points are read from the sources (`extern "C" __global__ void NAME(`), not listed by
//! hand, so a new kernel needs no second edit. A name pasted together inside a macro
//! (`qccl_reduce_##op##_##T`) comes back as a pattern with `*` for each macro parameter
//! (`qccl_reduce_*_*`); [`matches`] tests a compiled name against it. tests/kernels_nvrtc.rs
//! checks both ways against the PTX NVRTC makes, and that the lists hold the folder's files.

/// One file of `kernels/`.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// File name inside `kernels/`, e.g. `reduce.cu`; also the name NVRTC reports errors under.
    pub file: &'static str,
    /// The file's text.
    pub text: &'static str,
}

// SOURCES and HEADERS: the folder's files, listed by build.rs.
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The dtype part of a kernel's entry name (`qccl_reduce_sum_f32`), as kernels/ spells it
/// (every dtype has kernels: a new one fails to compile here until it has).
pub fn dtype_suffix(d: crate::DType) -> &'static str {
    use crate::DType;
    match d {
        DType::Int8 => "i8",
        DType::Uint8 => "u8",
        DType::Int32 => "i32",
        DType::Uint32 => "u32",
        DType::Int64 => "i64",
        DType::Uint64 => "u64",
        DType::Float16 => "f16",
        DType::Float32 => "f32",
        DType::Float64 => "f64",
        DType::Bfloat16 => "bf16",
    }
}

impl Source {
    /// The entry points this file defines, in source order; a macro-pasted name is a pattern
    /// (see the module documentation).
    pub fn entry_points(&self) -> Vec<String> {
        entry_points(self.text)
    }
}

/// The entry points of a CUDA source (see [`Source::entry_points`]).
pub fn entry_points(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (chunk, params) in chunks(&strip_comments(text)) {
        let mut rest = chunk.as_str();
        while let Some(at) = rest.find("extern") {
            rest = &rest[at + "extern".len()..];
            if let Some((name, tail)) = declaration(rest, &params) {
                out.push(name);
                rest = tail;
            }
        }
    }
    out
}

/// The files that may define entry point `name` (their entry points match it), for a driver
/// to load in turn; `InvalidArgument` when `name` is not a C identifier or no file matches.
pub fn sources_for(name: &str) -> crate::Result<Vec<&'static Source>> {
    let plain = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !plain {
        return Err(crate::Error::invalid(format!(
            "kernel name {name:?} is not a C identifier"
        )));
    }
    let found: Vec<_> = SOURCES
        .iter()
        .filter(|s| s.entry_points().iter().any(|p| matches(p, name)))
        .collect();
    if found.is_empty() {
        return Err(unknown_kernel(name));
    }
    Ok(found)
}

/// The error for a kernel no file of kernels/ defines.
pub fn unknown_kernel(name: &str) -> crate::Error {
    crate::Error::invalid(format!("no kernel named {name:?} in qccl's kernels/"))
}

/// Whether `name` is matched by `pattern`, where each `*` stands for one or more characters.
pub fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            let Some(rest) = name.strip_prefix(head) else {
                return false;
            };
            // `*` takes at least one character, then the rest must match.
            (1..=rest.len())
                .filter(|&i| rest.is_char_boundary(i))
                .any(|i| matches(tail, &rest[i..]))
        }
    }
}

/// After `extern`: `"C" __global__ [__launch_bounds__(..)] void [__launch_bounds__(..)] NAME(`,
/// NAME possibly pasted with `##`. Returns the name (parameters as `*`) and what follows it.
fn declaration<'a>(s: &'a str, params: &[String]) -> Option<(String, &'a str)> {
    let s = s.trim_start().strip_prefix("\"C\"")?;
    let mut s = s.trim_start();
    let mut seen_global = false;
    let mut seen_void = false;
    loop {
        let (word, rest) = ident(s)?;
        match word {
            "__global__" => seen_global = true,
            "void" => seen_void = true,
            "__launch_bounds__" => {
                let rest = rest.trim_start().strip_prefix('(')?;
                s = &rest[rest.find(')')? + 1..];
                s = s.trim_start();
                continue;
            }
            _ if seen_global && seen_void => {
                // The name: identifiers joined by `##`, then `(`.
                let mut name = String::new();
                let mut part = word;
                let mut rest = rest;
                loop {
                    if params.iter().any(|p| p == part) {
                        name.push('*');
                    } else {
                        name.push_str(part);
                    }
                    let after = rest.trim_start();
                    if let Some(after) = after.strip_prefix("##") {
                        let (next, r) = ident(after.trim_start())?;
                        part = next;
                        rest = r;
                    } else if after.starts_with('(') {
                        return Some((name, after));
                    } else {
                        return None;
                    }
                }
            }
            _ => return None,
        }
        s = rest.trim_start();
    }
}

/// A leading C identifier of `s`, and the rest.
fn ident(s: &str) -> Option<(&str, &str)> {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    let first = s.chars().next()?;
    if end == 0 || first.is_ascii_digit() {
        return None;
    }
    Some(s.split_at(end))
}

/// The text in pieces a declaration cannot span: each preprocessor directive alone, with its
/// macro parameters, and the code between directives as one piece (a declaration may spread
/// over several lines).
fn chunks(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut code = String::new();
    for line in logical_lines(text) {
        if line.trim_start().starts_with('#') {
            out.push((std::mem::take(&mut code), Vec::new()));
            let params = macro_params(&line);
            out.push((line, params));
        } else {
            code.push_str(&line);
            code.push('\n');
        }
    }
    out.push((code, Vec::new()));
    out
}

/// The parameters of a `#define NAME(a, b)` line; empty for any other line.
fn macro_params(line: &str) -> Vec<String> {
    let Some(rest) = line.trim_start().strip_prefix('#') else {
        return Vec::new();
    };
    let Some(rest) = rest.trim_start().strip_prefix("define") else {
        return Vec::new();
    };
    let Some((_, after)) = ident(rest.trim_start()) else {
        return Vec::new();
    };
    // A function-like macro has `(` right after its name, no space.
    let Some(list) = after.strip_prefix('(') else {
        return Vec::new();
    };
    let Some(end) = list.find(')') else {
        return Vec::new();
    };
    list[..end]
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

/// Lines with backslash continuations joined, as the preprocessor sees them.
fn logical_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        match line.trim_end().strip_suffix('\\') {
            Some(body) => {
                cur.push_str(body);
                cur.push(' ');
            }
            None => {
                cur.push_str(line);
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// `text` without `//` and `/* */` comments (newlines kept, so lines stay lines). String and
/// character literals are copied as they are, so a `//` inside one is not a comment.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                    }
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
                out.push(' ');
            }
            '"' | '\'' => {
                out.push(c);
                let mut escaped = false;
                for d in chars.by_ref() {
                    out.push(d);
                    if escaped {
                        escaped = false;
                    } else if d == '\\' {
                        escaped = true;
                    } else if d == c || d == '\n' {
                        break;
                    }
                }
            }
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_declarations() {
        let src = "#include \"common.cuh\"\n\
                   extern \"C\" __global__ void a_kernel(float* x, int n) { }\n\
                   extern   \"C\"\n__global__\tvoid\nb_kernel (int n) {}\n\
                   extern \"C\" __device__ int not_a_kernel(int);\n\
                   extern \"C\" __global__ void __launch_bounds__(256) c_kernel(int n) {}\n\
                   extern \"C\" __global__ __launch_bounds__(128, 2) void d_kernel() {}\n";
        assert_eq!(
            entry_points(src),
            ["a_kernel", "b_kernel", "c_kernel", "d_kernel"]
        );
    }

    #[test]
    fn comments_and_strings_are_not_declarations() {
        let src = "// extern \"C\" __global__ void commented(int n) {}\n\
                   /* extern \"C\" __global__ void\n   blocked(int n) {} */\n\
                   const char* s = \"// not a comment\"; extern \"C\" __global__ void real(int n) {}\n";
        assert_eq!(entry_points(src), ["real"]);
    }

    #[test]
    fn pasted_names_become_patterns() {
        let src = "#define R(op, T, suffix) \\\n\
                   extern \"C\" __global__ void qccl_reduce_##op##_##suffix(T* o) { } \\\n\
                   extern \"C\" __global__ void qccl_fixed_##suffix(T* o) { }\n\
                   #define WHOLE(name) extern \"C\" __global__ void name(int n) {}\n\
                   #define OBJ extern \"C\" __global__ void obj_kernel(int n) {}\n\
                   R(sum, float, f32)\n";
        assert_eq!(
            entry_points(src),
            ["qccl_reduce_*_*", "qccl_fixed_*", "*", "obj_kernel"]
        );
    }

    #[test]
    fn patterns_match_whole_names() {
        assert!(matches("qccl_reduce_*_*", "qccl_reduce_sum_f32"));
        assert!(matches("qccl_reduce_*_*", "qccl_reduce_sum_max_f32"));
        assert!(!matches("qccl_reduce_*_*", "qccl_reduce_sum_"));
        assert!(!matches("qccl_reduce_*_*", "qccl_finish_avg_f32"));
        assert!(matches("exact", "exact"));
        assert!(!matches("exact", "exactly"));
        assert!(matches("*", "anything"));
        assert!(!matches("*", ""));
    }

    #[test]
    fn kernel_names_find_their_files() {
        let files = |n| -> Vec<&str> { sources_for(n).unwrap().iter().map(|s| s.file).collect() };
        assert_eq!(files("qccl_reduce_sum_f32"), ["reduce.cu"]);
        assert_eq!(files("qccl_fp16_encode"), ["floats.cu"]);
        for bad in ["", "1abc", "a-b", "qccl_reduce_sum_f32\0"] {
            assert!(sources_for(bad).is_err(), "{bad:?}");
        }
        let e = sources_for("qccl_no_such_kernel").unwrap_err().to_string();
        assert!(e.contains("qccl_no_such_kernel"), "{e}");
    }

    #[test]
    fn embedded_sources_declare_entry_points() {
        // Every kernel file exports something; a file whose entry points the parser misses would
        // be compiled for nothing.
        for s in SOURCES {
            assert!(
                !s.entry_points().is_empty(),
                "{}: no entry point found",
                s.file
            );
        }
    }
}
