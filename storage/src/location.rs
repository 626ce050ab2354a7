//! A location: a local path, or an object URL, and the [`Store`] that serves it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::ObjectStore;

use crate::error::{Error, Result};
use crate::store::Store;

/// The kind of store a location is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// This machine's file system (a path, or `file://`).
    Local,
    /// AWS S3 or an S3-compatible store (`s3://bucket/key`).
    S3,
    /// Google Cloud Storage (`gs://bucket/key`).
    Gcs,
    /// Azure Blob Storage (`az://container/key`).
    Azure,
}

impl Scheme {
    fn prefix(self) -> &'static str {
        match self {
            Scheme::Local => "file://",
            Scheme::S3 => "s3://",
            Scheme::Gcs => "gs://",
            Scheme::Azure => "az://",
        }
    }
}

/// A parsed path or object URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// Its store's kind.
    pub scheme: Scheme,
    /// The bucket (container); empty for a local path.
    pub bucket: String,
    /// The object's key in the bucket (no leading `/`); for a local path, the path
    /// itself.
    pub key: String,
}

impl Location {
    /// Reads `text`: `s3://bucket/key`, `gs://bucket/key`, `az://container/key`,
    /// `file:///absolute/path`, or a path (relative to the working directory).
    pub fn parse(text: &str) -> Result<Location> {
        let bad = |why: String| Error::BadUrl {
            url: text.to_owned(),
            why,
        };
        let Some((scheme, rest)) = text.split_once("://") else {
            if text.is_empty() {
                return Err(bad("an empty path".to_owned()));
            }
            return Ok(Location {
                scheme: Scheme::Local,
                bucket: String::new(),
                key: text.to_owned(),
            });
        };
        let scheme = match scheme {
            "s3" | "s3a" => Scheme::S3,
            "gs" => Scheme::Gcs,
            "az" | "azure" => Scheme::Azure,
            "file" => {
                if !rest.starts_with('/') {
                    return Err(bad(
                        "a file URL needs an absolute path (file:///data/...)".to_owned()
                    ));
                }
                return Ok(Location {
                    scheme: Scheme::Local,
                    bucket: String::new(),
                    key: rest.to_owned(),
                });
            }
            other => {
                return Err(bad(format!(
                    "unsupported scheme {other:?}: use a path, file://, s3://, gs:// or az://"
                )));
            }
        };
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad(format!(
                "no bucket: write {}BUCKET/KEY",
                scheme.prefix()
            )));
        }
        if key.split('/').any(|part| part == "." || part == "..") {
            return Err(bad(
                "`.` and `..` are not allowed in an object key".to_owned()
            ));
        }
        Ok(Location {
            scheme,
            bucket: bucket.to_owned(),
            key: key.trim_matches('/').to_owned(),
        })
    }

    /// Whether it is in an object store (not a local path).
    pub fn is_object(&self) -> bool {
        self.scheme != Scheme::Local
    }

    /// The location as a URL (a local path as it was given).
    pub fn url(&self) -> String {
        match self.scheme {
            Scheme::Local => self.key.clone(),
            s => format!("{}{}/{}", s.prefix(), self.bucket, self.key),
        }
    }

    /// `name` under this location (a child path or key).
    pub fn join(&self, name: &str) -> Location {
        let key = match self.scheme {
            Scheme::Local => Path::new(&self.key).join(name).display().to_string(),
            _ if self.key.is_empty() => name.trim_matches('/').to_owned(),
            _ => format!("{}/{}", self.key, name.trim_matches('/')),
        };
        Location {
            key,
            ..self.clone()
        }
    }

    /// The store that serves this location, made from the environment's credentials
    /// and endpoints, and the key in it. A local path gets the file system, with the
    /// path made absolute.
    pub fn open(&self) -> Result<(Store, String)> {
        self.open_with(std::env::vars())
    }

    /// [`Location::open`] with these variables in place of the environment's.
    pub fn open_with(
        &self,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Store, String)> {
        match self.scheme {
            Scheme::Local => {
                let path = absolute(Path::new(&self.key)).map_err(|e| Error::BadUrl {
                    url: self.key.clone(),
                    why: e.to_string(),
                })?;
                let key = path
                    .display()
                    .to_string()
                    .trim_start_matches('/')
                    .to_owned();
                let fs: Arc<dyn ObjectStore> =
                    Arc::new(object_store::local::LocalFileSystem::new());
                Ok((Store::new(fs, Scheme::Local, String::new()), key))
            }
            scheme => {
                let vars: BTreeMap<String, String> =
                    vars.into_iter().filter(|(_, v)| !v.is_empty()).collect();
                let store = self.build(scheme, &vars)?;
                Ok((
                    Store::new(store, scheme, self.bucket.clone()),
                    self.key.clone(),
                ))
            }
        }
    }

    fn build(
        &self,
        scheme: Scheme,
        vars: &BTreeMap<String, String>,
    ) -> Result<Arc<dyn ObjectStore>> {
        // HTTPS to the store uses the process's rustls provider: ring, edl's one crypto
        // stack (a provider the process installed already stays).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let url = self.url();
        let env = |k: &str| vars.get(k).cloned();
        // The builder's own keys (`aws_*`, `google_*`, `azure_*`), as `from_env` takes
        // them, from these variables.
        let config = |prefix: &str| -> Vec<(String, String)> {
            vars.iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
                .collect()
        };
        let set = |k: &str| env(k).is_some();
        let truthy = |k: &str| env(k).is_some_and(|v| v == "true" || v == "1");
        let failed = |e: object_store::Error| Error::BadUrl {
            url: url.clone(),
            why: e.to_string(),
        };
        let store: Arc<dyn ObjectStore> = match scheme {
            Scheme::S3 => {
                let has = (set("AWS_ACCESS_KEY_ID") && set("AWS_SECRET_ACCESS_KEY"))
                    || truthy("AWS_SKIP_SIGNATURE")
                    || set("AWS_WEB_IDENTITY_TOKEN_FILE")
                    || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
                    || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
                    || set("AWS_METADATA_ENDPOINT");
                if !has {
                    return Err(Error::Credentials {
                        url,
                        store: "S3",
                        fix: "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and \
                              AWS_ENDPOINT_URL for an S3-compatible store), \
                              AWS_WEB_IDENTITY_TOKEN_FILE (IRSA), AWS_METADATA_ENDPOINT \
                              to use the instance's credentials, or AWS_SKIP_SIGNATURE=true \
                              for a public bucket",
                    });
                }
                let mut b = object_store::aws::AmazonS3Builder::new();
                for (k, v) in config("AWS_") {
                    if let Ok(key) = k.parse() {
                        b = b.with_config(key, v);
                    }
                }
                let mut b = b
                    .with_bucket_name(&self.bucket)
                    .with_retry(retry(&vars.get(RETRY_VAR).cloned(), &url)?);
                if env("AWS_REGION").is_none() && env("AWS_DEFAULT_REGION").is_none() {
                    b = b.with_region("us-east-1");
                }
                if let Some(endpoint) = env("AWS_ENDPOINT_URL").or_else(|| env("AWS_ENDPOINT")) {
                    // An S3-compatible store: path-style requests, as most expect.
                    b = b
                        .with_endpoint(endpoint)
                        .with_virtual_hosted_style_request(false);
                }
                Arc::new(b.build().map_err(failed)?)
            }
            Scheme::Gcs => {
                let has = set("GOOGLE_SERVICE_ACCOUNT")
                    || set("GOOGLE_SERVICE_ACCOUNT_PATH")
                    || set("GOOGLE_SERVICE_ACCOUNT_KEY")
                    || set("GOOGLE_APPLICATION_CREDENTIALS")
                    || truthy("GOOGLE_SKIP_SIGNATURE");
                if !has {
                    return Err(Error::Credentials {
                        url,
                        store: "Google Cloud Storage",
                        fix: "set GOOGLE_APPLICATION_CREDENTIALS to a service account key \
                              file (or GOOGLE_SERVICE_ACCOUNT_KEY to its JSON)",
                    });
                }
                let mut b = object_store::gcp::GoogleCloudStorageBuilder::new();
                for (k, v) in config("GOOGLE_") {
                    if let Ok(key) = k.parse() {
                        b = b.with_config(key, v);
                    }
                }
                if let Some(file) = env("GOOGLE_APPLICATION_CREDENTIALS") {
                    b = b.with_application_credentials(file);
                }
                let b = b
                    .with_bucket_name(&self.bucket)
                    .with_retry(retry(&vars.get(RETRY_VAR).cloned(), &url)?);
                Arc::new(b.build().map_err(failed)?)
            }
            Scheme::Azure => {
                let has = set("AZURE_STORAGE_ACCOUNT_NAME")
                    && (set("AZURE_STORAGE_ACCOUNT_KEY")
                        || set("AZURE_STORAGE_SAS_KEY")
                        || set("AZURE_STORAGE_TOKEN")
                        || set("AZURE_CLIENT_SECRET")
                        || set("AZURE_FEDERATED_TOKEN_FILE"))
                    || truthy("AZURE_STORAGE_USE_EMULATOR");
                if !has {
                    return Err(Error::Credentials {
                        url,
                        store: "Azure Blob Storage",
                        fix: "set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY \
                              (or a SAS key, a token, or a service principal)",
                    });
                }
                let mut b = object_store::azure::MicrosoftAzureBuilder::new();
                for (k, v) in config("AZURE_") {
                    if let Ok(key) = k.parse() {
                        b = b.with_config(key, v);
                    }
                }
                let b = b
                    .with_container_name(&self.bucket)
                    .with_retry(retry(&vars.get(RETRY_VAR).cloned(), &url)?);
                Arc::new(b.build().map_err(failed)?)
            }
            Scheme::Local => unreachable!("a local path has no object store"),
        };
        Ok(store)
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url())
    }
}

/// The variable that sets how long a request to an object store is retried.
pub const RETRY_VAR: &str = "EDL_STORAGE_RETRY_TIMEOUT";

/// How a request to an object store is retried: transient failures (a 5xx, a reset
/// connection, a timeout) with exponential backoff, for up to `timeout`
/// ([`RETRY_VAR`], a duration such as `30s`; default 30 s) in all.
fn retry(timeout: &Option<String>, url: &str) -> Result<object_store::RetryConfig> {
    let retry_timeout = match timeout {
        None => std::time::Duration::from_secs(30),
        Some(t) => humantime::parse_duration(t).map_err(|e| Error::BadUrl {
            url: url.to_owned(),
            why: format!("{RETRY_VAR}={t:?}: {e} (a duration such as 30s)"),
        })?,
    };
    Ok(object_store::RetryConfig {
        backoff: object_store::BackoffConfig::default(),
        max_retries: 10,
        retry_timeout,
    })
}

fn absolute(path: &Path) -> std::io::Result<PathBuf> {
    if path.is_absolute() {
        Ok(path.to_path_buf())
    } else {
        Ok(std::env::current_dir()?.join(path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_urls_parse_and_bad_ones_say_why() {
        let s3 = Location::parse("s3://data/mnist/train-*.recordio").expect("s3");
        assert_eq!(
            (s3.scheme, s3.bucket.as_str(), s3.key.as_str()),
            (Scheme::S3, "data", "mnist/train-*.recordio")
        );
        assert_eq!(s3.url(), "s3://data/mnist/train-*.recordio");
        assert_eq!(s3.join("x").url(), "s3://data/mnist/train-*.recordio/x");
        assert_eq!(Location::parse("gs://b").expect("gs").key, "");
        assert_eq!(
            Location::parse("az://c/k").expect("az").scheme,
            Scheme::Azure
        );
        let local = Location::parse("data/train-0.recordio").expect("path");
        assert!(!local.is_object());
        assert_eq!(Location::parse("file:///d/x").expect("file").key, "/d/x");
        for (bad, says) in [
            ("s3:///key", "no bucket"),
            ("ftp://host/x", "unsupported scheme"),
            ("file://relative/x", "absolute path"),
            ("s3://b/a/../c", "not allowed"),
            ("", "empty"),
        ] {
            let e = Location::parse(bad).expect_err(bad).to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
