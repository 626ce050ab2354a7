//! Object storage from the command line, against a real S3 server (`edl-s3-server` on
//! loopback): `edl data put` uploads a dataset and `edl data ls` lists it (sizes and
//! URLs, globs too); missing credentials and a bad URL are one clear error each.

use std::process::{Command, Output};

use edl_testkit::s3::S3Server;

use crate::support::edl_bin;

/// `edl ARGS` with `vars` only (no AWS variables of this machine's environment).
fn edl(args: &[&str], vars: &[(String, String)]) -> Output {
    let mut cmd = Command::new(edl_bin());
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args)
        .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .expect("run edl")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn edl_data_put_and_ls_move_a_dataset_to_s3_and_bad_input_is_one_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = S3Server::start(&dir.path().join("s3")).expect("the S3 server");
    server.create_bucket("datasets").expect("bucket");
    let local = dir.path().join("mnist");
    std::fs::create_dir_all(&local).expect("mkdir");
    for (name, len) in [
        ("train-00000-of-00002.recordio", 1000usize),
        ("train-00001-of-00002.recordio", 2500),
        ("test-00000-of-00001.recordio", 300),
    ] {
        std::fs::write(local.join(name), vec![7u8; len]).expect("write");
    }
    let vars = server.env();
    let out = edl(
        &[
            "data",
            "put",
            &local.display().to_string(),
            "s3://datasets/mnist/",
        ],
        &vars,
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        3,
        "one line per file: {}",
        text(&out)
    );
    // On the server's disk: the S3 server stored them.
    assert_eq!(
        std::fs::read(
            dir.path()
                .join("s3/datasets/mnist/train-00001-of-00002.recordio")
        )
        .expect("the object on the server's disk")
        .len(),
        2500
    );
    let out = edl(&["data", "ls", "s3://datasets/mnist/"], &vars);
    assert!(out.status.success(), "{}", text(&out));
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(listing.lines().count(), 3, "{listing}");
    assert!(
        listing.contains("2500  s3://datasets/mnist/train-00001-of-00002.recordio"),
        "{listing}"
    );
    let out = edl(
        &["data", "ls", "s3://datasets/mnist/train-*.recordio"],
        &vars,
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        2,
        "{}",
        text(&out)
    );

    // No credentials: one error naming what to set, and a failure.
    let endpoint_only: Vec<(String, String)> = vars
        .iter()
        .filter(|(k, _)| !k.starts_with("AWS_ACCESS") && !k.starts_with("AWS_SECRET"))
        .cloned()
        .collect();
    let out = edl(&["data", "ls", "s3://datasets/mnist/"], &endpoint_only);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        said.contains("no credentials for S3") && said.contains("AWS_ACCESS_KEY_ID"),
        "{said}"
    );
    assert_eq!(
        said.matches("no credentials").count(),
        1,
        "said once: {said}"
    );
    // A URL edl cannot use.
    let out = edl(&["data", "ls", "ftp://host/x"], &vars);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unsupported scheme \"ftp\""),
        "{}",
        text(&out)
    );
}
