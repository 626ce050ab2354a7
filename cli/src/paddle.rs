//! Seed compatibility: `edl` started without a subcommand but with PaddlePaddle's
//! environment variables runs the matching role, so the commands of the PaddlePaddle
//! tutorials work with `edl` in place of the Python script.
//!
//! | variable | meaning |
//! |---|---|
//! | `PADDLE_TRAINING_ROLE` | `PSERVER` or `TRAINER` (any case) |
//! | `PADDLE_PSERVER_EPS` | the pservers' `ip:port` list (comma-separated): the shard count |
//! | `PADDLE_CURRENT_ENDPOINT` | a pserver's own `ip:port`: its listen address, and its index in the list |
//! | `PADDLE_TRAINER_ID` | a trainer's number: its id is `trainer-<N>` |
//! | `PADDLE_TRAINERS` | the trainer count (informational: edl trainers are elastic) |
//!
//! edl also needs what Paddle's variables do not say: `EDL_ETCD` (etcd URLs), `EDL_JOB`
//! (the job), and optionally `EDL_SPEC` (a job spec a trainer stores if the job has none)
//! and `EDL_CHECKPOINT_DIR` (default `./checkpoints`).

/// The `edl` arguments of the role the environment names (`env` reads a variable).
pub fn role_args(env: impl Fn(&str) -> Option<String>) -> anyhow::Result<Vec<String>> {
    let role = env("PADDLE_TRAINING_ROLE").ok_or_else(|| {
        anyhow::anyhow!("no command given (see `edl --help`), and PADDLE_TRAINING_ROLE is not set")
    })?;
    anyhow::ensure!(
        env(edl_job::env::ETCD).is_some() && env(edl_job::env::JOB).is_some(),
        "PADDLE_TRAINING_ROLE={role}: edl also needs EDL_ETCD (etcd URLs) and EDL_JOB (the job name)"
    );
    match role.to_ascii_lowercase().as_str() {
        "pserver" => {
            let eps = env("PADDLE_PSERVER_EPS").ok_or_else(|| {
                anyhow::anyhow!("PADDLE_TRAINING_ROLE=PSERVER needs PADDLE_PSERVER_EPS")
            })?;
            let eps: Vec<&str> = eps
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .collect();
            let me = env("PADDLE_CURRENT_ENDPOINT").ok_or_else(|| {
                anyhow::anyhow!("PADDLE_TRAINING_ROLE=PSERVER needs PADDLE_CURRENT_ENDPOINT")
            })?;
            let index = eps.iter().position(|e| *e == me).ok_or_else(|| {
                anyhow::anyhow!("PADDLE_CURRENT_ENDPOINT {me} is not in PADDLE_PSERVER_EPS {eps:?}")
            })?;
            let dir = env(edl_job::env::CHECKPOINT_DIR).unwrap_or_else(|| "checkpoints".into());
            let launch = edl_job::PserverLaunch {
                index: edl_job::launch::IndexChoice::Fixed(index as u32),
                shards: Some(eps.len() as u32),
                ..edl_job::PserverLaunch::new(dir)
            };
            let mut args = vec![
                "pserver".into(),
                "--listen".into(),
                me.clone(),
                "--advertise".into(),
                me,
            ];
            args.extend(launch.args());
            Ok(args)
        }
        "trainer" => {
            let mut args = vec!["trainer".to_owned()];
            if let Some(id) = env("PADDLE_TRAINER_ID") {
                anyhow::ensure!(
                    id.parse::<u32>().is_ok(),
                    "PADDLE_TRAINER_ID must be a number, not {id:?}"
                );
                args.extend(["--id".into(), format!("trainer-{id}")]);
            }
            if let Some(spec) = env(edl_job::env::SPEC) {
                args.extend(["--spec".into(), spec]);
            }
            Ok(args)
        }
        other => anyhow::bail!("PADDLE_TRAINING_ROLE={other}: expected PSERVER or TRAINER"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::role_args;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    const BASE: [(&str, &str); 2] = [("EDL_ETCD", "http://127.0.0.1:2379"), ("EDL_JOB", "fit")];

    #[test]
    fn a_pserver_takes_its_index_from_its_endpoint() {
        let mut vars = BASE.to_vec();
        vars.extend([
            ("PADDLE_TRAINING_ROLE", "PSERVER"),
            ("PADDLE_PSERVER_EPS", "127.0.0.1:6174,127.0.0.1:6175"),
            ("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:6175"),
        ]);
        let args = role_args(env(&vars)).expect("pserver");
        assert_eq!(args[0], "pserver");
        assert!(args.windows(2).any(|w| w == ["--listen", "127.0.0.1:6175"]));
        let cli = <crate::Cli as clap::Parser>::try_parse_from(
            std::iter::once("edl".to_owned())
                .chain(args)
                .chain(["--etcd", "http://127.0.0.1:2379", "--job", "fit"].map(String::from)),
        );
        let Ok(crate::Cli {
            command: Some(crate::Command::Pserver(p)),
            ..
        }) = cli
        else {
            panic!("not a pserver: {cli:?}");
        };
        let launch = p.launch();
        assert_eq!(launch.index, edl_job::launch::IndexChoice::Fixed(1));
        assert_eq!(launch.shards, Some(2));
        assert_eq!(launch.checkpoint_dir, "checkpoints");
    }

    #[test]
    fn a_trainer_takes_its_id() {
        let mut vars = BASE.to_vec();
        vars.extend([
            ("PADDLE_TRAINING_ROLE", "trainer"),
            ("PADDLE_TRAINER_ID", "3"),
        ]);
        assert_eq!(
            role_args(env(&vars)).expect("trainer"),
            ["trainer", "--id", "trainer-3"]
        );
    }

    #[test]
    fn missing_or_wrong_variables_are_clear_errors() {
        let e = role_args(env(&[])).expect_err("no role");
        assert!(e.to_string().contains("PADDLE_TRAINING_ROLE"), "{e}");
        let e = role_args(env(&[("PADDLE_TRAINING_ROLE", "PSERVER")])).expect_err("no etcd");
        assert!(e.to_string().contains("EDL_ETCD"), "{e}");
        let mut vars = BASE.to_vec();
        vars.extend([
            ("PADDLE_TRAINING_ROLE", "PSERVER"),
            ("PADDLE_PSERVER_EPS", "a:1,b:2"),
            ("PADDLE_CURRENT_ENDPOINT", "c:3"),
        ]);
        let e = role_args(env(&vars)).expect_err("not listed");
        assert!(e.to_string().contains("c:3"), "{e}");
        let mut vars = BASE.to_vec();
        vars.push(("PADDLE_TRAINING_ROLE", "MASTER"));
        assert!(role_args(env(&vars)).is_err());
    }
}
