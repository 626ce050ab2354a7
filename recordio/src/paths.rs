//! Dataset paths: expanding glob patterns into a sorted list of files.

use std::fs;
use std::io;
use std::path::PathBuf;

use crate::error::{Error, Result};

/// Expands glob patterns (`*`, `?`, `[...]`, `**`) into files, sorted and deduplicated.
///
/// A pattern naming an existing path is taken as is, even if it contains glob
/// characters. Wildcards do not match a leading `.`, so the temporary files of
/// unfinished [`FileWriter`](crate::FileWriter)s are never picked up, and directories
/// matched by a wildcard are left out. A pattern that matches no file is an
/// [`Error::NoMatch`] naming it; an unparsable one is an [`Error::Glob`].
pub fn expand_globs(patterns: &[String]) -> Result<Vec<PathBuf>> {
    let options = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: true,
    };
    let mut files = Vec::new();
    for pattern in patterns {
        let is_glob = pattern.contains(['*', '?', '[']);
        match fs::metadata(pattern) {
            Ok(_) => {
                files.push(PathBuf::from(pattern));
                continue;
            }
            Err(e) if !is_glob => {
                return Err(if e.kind() == io::ErrorKind::NotFound {
                    Error::NoMatch {
                        pattern: pattern.clone(),
                    }
                } else {
                    Error::io(pattern, e)
                });
            }
            Err(_) => {}
        }
        let matches = glob::glob_with(pattern, options).map_err(|e| Error::Glob {
            pattern: pattern.clone(),
            reason: e.to_string(),
        })?;
        let before = files.len();
        for entry in matches {
            let path = entry.map_err(|e| {
                let path = e.path().to_path_buf();
                Error::io(path, io::Error::from(e))
            })?;
            let meta = fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
            if !meta.is_dir() {
                files.push(path);
            }
        }
        if files.len() == before {
            return Err(Error::NoMatch {
                pattern: pattern.clone(),
            });
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(dir: &std::path::Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, b"").unwrap();
        path
    }

    fn s(p: &std::path::Path) -> String {
        p.to_str().unwrap().to_owned()
    }

    #[test]
    fn expands_sorts_and_dedups() {
        let dir = tempfile::tempdir().unwrap();
        let b = touch(dir.path(), "part-b");
        let a = touch(dir.path(), "part-a");
        touch(dir.path(), ".part-c.tmp-1-0");
        fs::create_dir(dir.path().join("part-dir")).unwrap();
        let got = expand_globs(&[s(&dir.path().join("part-*")), s(&a), s(&b)]).unwrap();
        assert_eq!(got, vec![a.clone(), b]);
        // A plain existing path passes through, even with glob characters in its name.
        let odd = touch(dir.path(), "odd[1]");
        assert_eq!(expand_globs(&[s(&odd)]).unwrap(), vec![odd]);
        assert_eq!(expand_globs(&[]).unwrap(), Vec::<PathBuf>::new());
    }

    #[test]
    fn reports_patterns_that_match_nothing() {
        let dir = tempfile::tempdir().unwrap();
        touch(dir.path(), "x");
        let missing = s(&dir.path().join("nothing-*"));
        let err = expand_globs(&[s(&dir.path().join("x")), missing.clone()]).unwrap_err();
        assert!(matches!(&err, Error::NoMatch { pattern } if *pattern == missing));
        assert!(err.to_string().contains("nothing-*"));
        let plain = s(&dir.path().join("absent"));
        assert!(matches!(
            expand_globs(&[plain]).unwrap_err(),
            Error::NoMatch { .. }
        ));
        let bad = s(&dir.path().join("[z"));
        assert!(matches!(
            expand_globs(&[bad]).unwrap_err(),
            Error::Glob { .. }
        ));
    }
}
