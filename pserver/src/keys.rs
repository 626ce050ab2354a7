//! The pserver's etcd keys (see docs/design.md), all under `/edl/<job>/`.

/// Keys of one job used by pservers and their clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PsKeys {
    root: String,
}

impl PsKeys {
    /// The keys of job `job`.
    pub fn new(job: &str) -> PsKeys {
        PsKeys {
            root: format!("/edl/{job}/"),
        }
    }

    /// `/edl/<job>/`.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The number of shards (no lease).
    pub fn desired(&self) -> String {
        format!("{}ps/desired", self.root)
    }

    /// The prefix of the shard claims `ps/<index>`.
    pub fn ps_prefix(&self) -> String {
        format!("{}ps/", self.root)
    }

    /// The claim of shard `index` (under the pserver's lease).
    pub fn ps(&self, index: u32) -> String {
        format!("{}ps/{index}", self.root)
    }

    /// Which trainer initialised the parameters, and when (no lease).
    pub fn params_init(&self) -> String {
        format!("{}params/init", self.root)
    }

    /// The model spec and settings the parameters were initialised with (no lease).
    pub fn params_spec(&self) -> String {
        format!("{}params/spec", self.root)
    }

    /// The election among trainers for the right to initialise.
    pub fn params_init_election(&self) -> String {
        format!("{}params/init-election/", self.root)
    }

    /// The trainer registry prefix.
    pub fn trainers(&self) -> String {
        format!("{}trainers/", self.root)
    }

    /// Everything about checkpoints.
    pub fn checkpoints(&self) -> String {
        format!("{}checkpoints/", self.root)
    }

    /// The manifest of the checkpoint of `step`.
    pub fn manifest(&self, step: u64) -> String {
        format!("{}checkpoints/{step}", self.root)
    }

    /// The step of the newest complete manifest.
    pub fn latest(&self) -> String {
        format!("{}checkpoints/latest", self.root)
    }

    /// The checkpoint requested by shard 0 (the checkpoint coordinator).
    pub fn request(&self) -> String {
        format!("{}checkpoints/request", self.root)
    }

    /// The prefix of the shard files written for `step`, before its manifest.
    pub fn parts(&self, step: u64) -> String {
        format!("{}checkpoints/parts/{step}/", self.root)
    }

    /// The prefix of every part.
    pub fn all_parts(&self) -> String {
        format!("{}checkpoints/parts/", self.root)
    }

    /// The file of shard `shard` written for `step`.
    pub fn part(&self, step: u64, shard: u32) -> String {
        format!("{}checkpoints/parts/{step}/{shard}", self.root)
    }

    /// The step of a manifest key (`checkpoints/<digits>`), if it is one.
    pub fn manifest_step(&self, key: &str) -> Option<u64> {
        let rest = key.strip_prefix(&self.checkpoints())?;
        if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        rest.parse().ok()
    }

    /// The index of a claim key (`ps/<canonical decimal>`), if it is one.
    pub fn ps_index(&self, key: &str) -> Option<u32> {
        let rest = key.strip_prefix(&self.ps_prefix())?;
        let i: u32 = rest.parse().ok()?;
        (i.to_string() == rest).then_some(i)
    }
}

/// Checks an id used as one etcd path segment (job, trainer).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 200 && !id.contains('/') && id.chars().all(|c| !c.is_control())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let k = PsKeys::new("j");
        assert_eq!(k.desired(), "/edl/j/ps/desired");
        assert_eq!(k.ps(3), "/edl/j/ps/3");
        assert_eq!(k.ps_index("/edl/j/ps/3"), Some(3));
        assert_eq!(k.ps_index("/edl/j/ps/desired"), None);
        assert_eq!(k.ps_index("/edl/j/ps/03"), None);
        assert_eq!(k.manifest(12), "/edl/j/checkpoints/12");
        assert_eq!(k.manifest_step("/edl/j/checkpoints/12"), Some(12));
        assert_eq!(k.manifest_step(&k.latest()), None);
        assert_eq!(k.manifest_step(&k.part(12, 0)), None);
        assert_eq!(k.manifest_step(&k.request()), None);
        assert!(k.part(4, 1).starts_with(&k.parts(4)));
        assert!(valid_id("trainer-1"));
        assert!(!valid_id("a/b"));
        assert!(!valid_id(""));
    }
}
