//! A real S3 server for tests: `edl-s3-server` (s3s-fs, an S3 implementation over a
//! directory; built with the workspace, found next to the test binaries) on a loopback
//! port of its own, with its own data directory and credentials. Killed on drop; its
//! data stays in the directory, so [`S3Server::restart`] brings the same objects back.
//! Faults can be injected in front of the store: every request answered `503`
//! ([`S3Server::fail_requests`]) or held ([`S3Server::stall_requests`]) until
//! [`S3Server::heal`].

use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use edl_coord::local_etcd::spawn_tied_to_process;

/// The access key the server takes.
pub const ACCESS_KEY: &str = "edl-test";
/// The secret key the server takes.
pub const SECRET_KEY: &str = "edl-test-secret";

/// One `edl-s3-server` process.
#[derive(Debug)]
pub struct S3Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// Its data directory (a folder per bucket).
    pub root: PathBuf,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `edl-s3-server` binary: `EDL_S3_SERVER_BIN`, or beside the running test binary
/// (`target/<profile>/`, the test being in `target/<profile>/deps/`).
pub fn s3_server_binary() -> io::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("EDL_S3_SERVER_BIN") {
        return Ok(bin.into());
    }
    let exe = std::env::current_exe()?;
    let dirs = exe.ancestors().skip(1).take(2);
    for dir in dirs {
        let bin = dir.join("edl-s3-server");
        if bin.try_exists()? {
            return Ok(bin);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "edl-s3-server is not built next to {}: build the workspace's binaries first \
             (cargo build --workspace --bins), as scripts/test does",
            exe.display()
        ),
    ))
}

/// The file the server reads its injected fault from: beside its data directory.
fn faults_file(root: &Path) -> PathBuf {
    let mut name = root.file_name().unwrap_or_default().to_os_string();
    name.push(".faults");
    root.with_file_name(name)
}

impl S3Server {
    /// Starts a server on a free loopback port with its data under `root`, and waits
    /// (up to 30 s) until it accepts connections.
    pub fn start(root: &Path) -> io::Result<S3Server> {
        Self::spawn(root, "127.0.0.1:0")
    }

    fn spawn(root: &Path, listen: &str) -> io::Result<S3Server> {
        let mut cmd = Command::new(s3_server_binary()?);
        cmd.arg("--root")
            .arg(root)
            .args(["--listen", listen])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg("--faults")
            .arg(faults_file(root))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = spawn_tied_to_process(cmd)?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other("edl-s3-server did not start within 30 s"));
            }
        };
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other(format!(
                "edl-s3-server did not start: {line:?}"
            )));
        };
        Ok(S3Server {
            endpoint: format!("http://{addr}"),
            child,
            root: root.to_path_buf(),
        })
    }

    /// Kills the server (SIGKILL); [`S3Server::restart`] brings it back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the server (SIGKILL) if it runs, and starts it again on the same port and
    /// data.
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill();
        let listen = self.endpoint.trim_start_matches("http://").to_owned();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match Self::spawn(&self.root, &listen) {
                Ok(new) => {
                    *self = new;
                    return Ok(());
                }
                // The old socket may linger a moment.
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// From now on every request is answered `503 SlowDown` (an overloaded store),
    /// until [`S3Server::heal`].
    pub fn fail_requests(&self) -> io::Result<()> {
        self.set_fault("error")
    }

    /// From now on requests are held unanswered (a stalled store), until
    /// [`S3Server::heal`] (then they are served).
    pub fn stall_requests(&self) -> io::Result<()> {
        self.set_fault("stall")
    }

    /// Ends an injected fault: requests are served again.
    pub fn heal(&self) -> io::Result<()> {
        self.set_fault("")
    }

    /// How many requests met an injected fault so far: (answered 503, held).
    pub fn fault_hits(&self) -> (usize, usize) {
        let mut hits = faults_file(&self.root).into_os_string();
        hits.push(".hits");
        let text = std::fs::read_to_string(hits).unwrap_or_default();
        let errors = text.lines().filter(|l| *l == "error").count();
        let stalls = text.lines().filter(|l| *l == "stall").count();
        (errors, stalls)
    }

    fn set_fault(&self, what: &str) -> io::Result<()> {
        let file = faults_file(&self.root);
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, what)?;
        std::fs::rename(tmp, file)
    }

    /// Makes bucket `name` (a folder of the data directory, as s3s-fs keeps buckets).
    pub fn create_bucket(&self, name: &str) -> io::Result<()> {
        std::fs::create_dir_all(self.root.join(name))
    }

    /// The variables a client (edl, object_store, the AWS SDKs) reaches this server
    /// with.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ENDPOINT_URL", self.endpoint.as_str()),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }
}
