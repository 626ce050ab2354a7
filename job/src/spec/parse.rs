//! Reading a job spec from its TOML file: errors name the key, line and column and the
//! file; relative paths (data globs, `data.prepare.from`) are resolved against the
//! file's folder.

use std::path::{Path, PathBuf};

use super::{JobSpec, SpecError};

impl JobSpec {
    /// Reads, parses, resolves (paths relative to the file) and validates a TOML spec.
    ///
    /// The values only a trainer can check (that the model builds, that the optimizer's
    /// settings are usable) are checked by `edl_trainer::job::load`, which calls this.
    pub fn load(path: &Path) -> Result<JobSpec, SpecError> {
        let in_file = |error: SpecError| SpecError::InFile {
            path: path.to_path_buf(),
            error: Box::new(error),
        };
        let text = std::fs::read_to_string(path).map_err(|e| SpecError::Read {
            path: path.to_path_buf(),
            error: e.to_string(),
        })?;
        let mut spec = Self::parse_toml(&text).map_err(in_file)?;
        let base = path
            .parent()
            .map(Path::to_path_buf)
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or_else(|| PathBuf::from("."));
        let base = std::path::absolute(&base).unwrap_or(base);
        spec.resolve_paths(&base);
        spec.validate().map_err(in_file)?;
        Ok(spec)
    }

    /// Parses TOML text (no path resolution, no validation): a syntax error, an unknown
    /// or missing key is [`SpecError::Syntax`] with its line and column.
    pub fn parse_toml(text: &str) -> Result<JobSpec, SpecError> {
        toml::from_str(text).map_err(|e| {
            let at = e.span().map(|span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                (line, column)
            });
            SpecError::Syntax {
                at,
                message: e.message().trim_end().to_owned(),
            }
        })
    }

    /// Makes relative data paths, a relative `cluster.checkpoint_dir`, and a relative
    /// `trainer.entry` program with a `/`, relative to `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        if let Some(program) = self.trainer.entry.first_mut()
            && program.contains('/')
            && Path::new(program.as_str()).is_relative()
        {
            *program = base.join(program.as_str()).to_string_lossy().into_owned();
        }
        self.data.train.resolve(base);
        if let Some(t) = &mut self.data.test {
            t.resolve(base);
        }
        if let Some(p) = &mut self.data.prepare
            && Path::new(&p.from).is_relative()
        {
            p.from = base.join(&p.from).to_string_lossy().into_owned();
        }
        // A URL (`s3://bucket/...`) is not a path.
        if let Some(dir) = &mut self.cluster.checkpoint_dir
            && Path::new(dir.as_str()).is_relative()
            && !dir.contains("://")
        {
            *dir = base.join(dir.as_str()).to_string_lossy().into_owned();
        }
    }
}
